/* env.c - the one parser of dpmini's numeric environment variables (env.h). */
#include "env.h"

#include <stdlib.h>

static int is_space(char c)
{
    return c == ' ' || c == '\t';
}

int dp_env_parse_uint(const char *text, unsigned long long lo, unsigned long long hi,
                      unsigned long long *out)
{
    if (text == NULL) {
        return DP_ENV_UNSET;
    }
    const char *p = text;
    while (is_space(*p)) {
        p++;
    }
    if (*p == '\0') {
        return DP_ENV_UNSET;
    }
    unsigned long long v = 0;
    int digits = 0;
    for (; *p >= '0' && *p <= '9'; p++, digits++) {
        unsigned d = (unsigned)(*p - '0');
        if (v > (~0ull - d) / 10) {
            return DP_ENV_INVALID;   /* past unsigned long long */
        }
        v = v * 10 + d;
    }
    while (is_space(*p)) {
        p++;
    }
    if (digits == 0 || *p != '\0' || v < lo || v > hi) {
        return DP_ENV_INVALID;
    }
    *out = v;
    return DP_ENV_OK;
}

int dp_env_uint(const char *name, unsigned long long lo, unsigned long long hi,
                unsigned long long *out)
{
    return dp_env_parse_uint(getenv(name), lo, hi, out);
}
