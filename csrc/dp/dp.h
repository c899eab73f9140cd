/* dp.h - what dp/ offers the module's init (module/module.c): the
 * DataParallel type (its spec) and the method tables of dpmini.replicate,
 * parallel_apply (with the replica context registry) and data_parallel.
 * What replicate.c and parallel_apply.c offer the DataParallel type is in
 * dataparallel.h.
 */
#ifndef DPMINI_DP_H
#define DPMINI_DP_H

#include "dpmini.h"

extern PyMethodDef dp_replicate_methods[];    /* replicate.c */
extern PyMethodDef dp_parallel_apply_methods[]; /* parallel_apply.c */
extern PyMethodDef dp_replica_context_methods[]; /* parallel_apply.c */
extern PyMethodDef dp_dataparallel_methods[]; /* dataparallel.c */
extern PyType_Spec dp_dataparallel_spec;      /* dataparallel.c */

#endif
