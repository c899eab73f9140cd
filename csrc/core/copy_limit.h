/* copy_limit.h - the machine's copy limit, measured: how fast `threads`
 * threads copy a contiguous buffer with libc memcpy and with streaming
 * (non-temporal) stores, the two ways the copy engine copies (copy.h).
 * A ratio to a physical limit takes the faster of the two, measured in the
 * same run as what it is compared with. Pure C. */
#ifndef DPMINI_COPY_LIMIT_H
#define DPMINI_COPY_LIMIT_H

#include <stdint.h>

/* Best of `repeat` copies of `bytes` bytes (split evenly over `threads`
 * threads, each with its own source and destination, pages touched
 * beforehand) with DP_COPY_ORDINARY (memcpy) or DP_COPY_STREAM: *seconds is
 * the best wall time. 0, or -1 when out of memory or a thread cannot start
 * (bytes 0 or threads < 1: -1). */
int dp_copy_limit_time(uint64_t bytes, int threads, int mode, int repeat, double *seconds);

#endif
