/* omp_team.h - keep the calling thread's OpenMP team off the cores while
 * other threads work.
 *
 * After an OpenMP parallel region ends, its worker threads wait for the
 * next region of the same master thread by spinning first (libgomp: about
 * 300,000 turns, milliseconds, unless OMP_WAIT_POLICY=passive; LLVM/Intel
 * runtimes: KMP_BLOCKTIME, 200 ms). When the master then hands work to
 * threads of its own (replicas on virtual CPU devices), those spinners
 * share the cores with that work. dp_omp_run_parked runs a function as the
 * master of one more region of its team, whose other threads sleep on a
 * condition variable until the function returns: they are off the cores,
 * and the region's end leaves the team as it was.
 *
 * The runtime is found among the loaded shared objects (libgomp, as
 * PyTorch's wheels bundle it; libiomp5 and libomp export libgomp's entry
 * points too), looked up again when a library was loaded or unloaded since
 * the last look. No Python.h.
 */
#ifndef DPMINI_OMP_TEAM_H
#define DPMINI_OMP_TEAM_H

typedef void (*dp_team_fn)(void *arg);

/* Run fn(arg) on the calling thread; its OpenMP team (of each loaded
 * runtime, at most four) sleeps meanwhile when the thread is not inside a
 * parallel region already and its team would have more than one thread
 * (omp_get_max_threads). fn runs inside that region: OpenMP code it calls
 * on this thread runs on one thread (nested regions are inactive), so fn
 * must not wait for OpenMP work of this thread. In a process forked after
 * this object was loaded fn always runs plain (a team does not survive
 * fork). A thread count fn sets (omp_set_num_threads) stays set after the
 * region. Returns the number of runtimes whose team was parked (0: fn ran
 * plain). */
int dp_omp_run_parked(dp_team_fn fn, void *arg);

/* Called by fn, on the thread running it, when its own threads' work is
 * done and only a short tail (a gather) is left: the parked threads wake
 * now and poll for the region's end, so that its end does not wait for
 * their wake-up. Nothing when the thread runs no parked region. */
void dp_omp_wake_parked(void);

#endif
