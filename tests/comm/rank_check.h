/* What the multi-rank test programs (tests/comm/..._rank_test.c) share: how a rank fails, and
 * the deterministic values every rank computes alike. */
#ifndef KT_TESTS_RANK_CHECK_H
#define KT_TESTS_RANK_CHECK_H

#include <stdint.h>

#include <kt/kt.h>

/* This process's rank, for messages (-1 until the test sets it). */
extern int rank_id;

/* Prints "FAIL rank R: <message>" and exits 1. */
void rank_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

/* A libkt call that must succeed: else rank_fail with the expression and the library's message. */
#define OK(expr)                                                                              \
    do {                                                                                      \
        kt_status s_ = (expr);                                                                \
        if (s_ != KT_OK)                                                                      \
            rank_fail("%s: %s", #expr, kt_last_error());                                      \
    } while (0)

/* A value in [-1, 1) from (seed, i): the same on every rank and run. */
float rank_value_at(uint64_t seed, int64_t i);

#endif
