/* check.h - the tiny harness the C unit tests share: a failure counter, the
 * CHECK macro (prints file:line and the condition, keeps going) and a
 * deterministic xorshift64* generator. Each test is one .c file with main()
 * returning failures != 0; tests/test_c_units.py compiles and runs them. */
#ifndef DPMINI_TEST_CHECK_H
#define DPMINI_TEST_CHECK_H

#include <stdint.h>
#include <stdio.h>

static int failures = 0;

#define CHECK(cond)                                                        \
    do {                                                                   \
        if (!(cond)) {                                                     \
            failures++;                                                    \
            printf("%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                  \
    } while (0)

/* The generator's state; a test may set its own seed before drawing. */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static inline uint64_t rnd(void)   /* xorshift64* */
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

/* Uniform in [0, n), n >= 1. */
static inline int64_t rnd_in(int64_t n) { return (int64_t)(rnd() % (uint64_t)n); }

#endif
