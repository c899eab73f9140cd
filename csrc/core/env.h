/* env.h - the one parser of dpmini's numeric environment variables
 * ($DPMINI_CPU_DEVICES, $DPMINI_CACHE_LIMIT, $DPMINI_2D_MIN_RUN).
 *
 * No Python.h: unit-tested on its own (tests/c/test_env.c).
 */
#ifndef DPMINI_ENV_H
#define DPMINI_ENV_H

/* dp_env_uint's results. */
enum {
    DP_ENV_UNSET = 0,    /* unset, empty or only spaces: use the default */
    DP_ENV_OK = 1,       /* *out holds the value                         */
    DP_ENV_INVALID = -1  /* set but not a decimal integer in [lo, hi]    */
};

/* Parse text as a non-negative decimal integer in [lo, hi]. The rule, the
 * same for every variable: ASCII spaces and tabs around the number are
 * ignored (" 4" is 4, as a shell or .env file may leave them); the number
 * itself is decimal digits only (no sign, no "0x", no "4k", no inner
 * spaces). text may be NULL (unset). *out is written only on DP_ENV_OK. */
int dp_env_parse_uint(const char *text, unsigned long long lo, unsigned long long hi,
                      unsigned long long *out);

/* dp_env_parse_uint(getenv(name), ...). */
int dp_env_uint(const char *name, unsigned long long lo, unsigned long long hi,
                unsigned long long *out);

#endif
