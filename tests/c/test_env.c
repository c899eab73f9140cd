/* test_env.c - unit tests for dp_env_parse_uint (csrc/core/env.c): the one rule
 * for dpmini's numeric environment variables.
 *
 * A standalone program run by tests/test_c_units.py.
 */
#include "env.h"

#include <stdio.h>
#include "check.h"

int main(void)
{
    unsigned long long v = 7;
    CHECK(dp_env_parse_uint(NULL, 0, 10, &v) == DP_ENV_UNSET && v == 7);
    CHECK(dp_env_parse_uint("", 0, 10, &v) == DP_ENV_UNSET && v == 7);
    CHECK(dp_env_parse_uint("  \t", 0, 10, &v) == DP_ENV_UNSET && v == 7);
    CHECK(dp_env_parse_uint("4", 1, 256, &v) == DP_ENV_OK && v == 4);
    CHECK(dp_env_parse_uint(" 4", 1, 256, &v) == DP_ENV_OK && v == 4);
    CHECK(dp_env_parse_uint("5 ", 0, 100, &v) == DP_ENV_OK && v == 5);
    CHECK(dp_env_parse_uint("\t05\t", 0, 100, &v) == DP_ENV_OK && v == 5);
    CHECK(dp_env_parse_uint("0", 0, 100, &v) == DP_ENV_OK && v == 0);
    CHECK(dp_env_parse_uint("18446744073709551615", 0, ~0ull, &v) == DP_ENV_OK &&
          v == ~0ull);
    v = 7;
    const char *bad[] = {"+4", "-4", "4x", "4k", "0x10", "4 4", "four", "1e3", "4.0",
                         "18446744073709551616", "99999999999999999999999", "\n4"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        if (dp_env_parse_uint(bad[i], 0, ~0ull, &v) != DP_ENV_INVALID) {
            printf("accepted %s\n", bad[i]);
            failures++;
        }
    }
    CHECK(v == 7);
    CHECK(dp_env_parse_uint("0", 1, 256, &v) == DP_ENV_INVALID);
    CHECK(dp_env_parse_uint("257", 1, 256, &v) == DP_ENV_INVALID);
    CHECK(dp_env_parse_uint("256", 1, 256, &v) == DP_ENV_OK && v == 256);
    return failures != 0;
}
