/* The multi-rank test programs' shared checks (rank_check.h). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "tests/comm/rank_check.h"

int rank_id = -1;

void rank_fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL rank %d: ", rank_id);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
    exit(1);
}

float rank_value_at(uint64_t seed, int64_t i)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + (uint64_t)i * 0xBF58476D1CE4E5B9ull;
    x ^= x >> 31;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 29;
    return (float)((double)(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}
