/* Test helpers: tensors on the heap, a seeded PRNG, float comparisons. Tests may allocate;
 * the library under test may not. Include after <cmocka.h>. */
#ifndef KT_TEST_UTIL_H
#define KT_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "kt/kt.h"

/* xorshift64*: the same sequence on every machine, for reproducible inputs. */
typedef struct tu_rng {
    uint64_t s;
} tu_rng;

void tu_rng_seed(tu_rng *r, uint64_t seed);
uint64_t tu_rng_next(tu_rng *r);
double tu_rng_uniform(tu_rng *r, double lo, double hi);
double tu_rng_normal(tu_rng *r);

/* A heap tensor (zeroed); free with tu_free. ndim 0 gives a scalar. */
kt_tensor tu_alloc(kt_dtype dtype, int ndim, const int64_t *shape);
void tu_free(kt_tensor *t);
#define TU_SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define TU_NDIM(...) ((int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))
/* tu_new(KT_F32, 2, 3) -> f32[2,3] */
#define tu_new(dtype, ...) tu_alloc((dtype), TU_NDIM(__VA_ARGS__), TU_SHAPE(__VA_ARGS__))

/* Element access as double, any dtype (contiguous tensors). */
double tu_get(const kt_tensor *t, int64_t i);
void tu_set(kt_tensor *t, int64_t i, double v);
/* Fill float tensors uniformly in [lo, hi); integer tensors with integers in [lo, hi). */
void tu_fill_uniform(kt_tensor *t, tu_rng *r, double lo, double hi);

/* A deep copy with the same dtype, or converted to another float dtype. */
kt_tensor tu_clone(const kt_tensor *t);
kt_tensor tu_convert(const kt_tensor *t, kt_dtype dtype);

/* max_i |a_i - b_i| / max(max_i |b_i|, floor): error relative to the reference b's scale. */
double tu_rel_err(const kt_tensor *a, const kt_tensor *b, double floor);
/* 1 when both tensors hold the same bytes. */
int tu_bitwise_equal(const kt_tensor *a, const kt_tensor *b);

/* Building graphs in tests: one op with one or two inputs, failing the test on error. */
kt_value tu_op1(kt_graph *g, const char *name, kt_op op, const kt_op_attrs *attrs, kt_value a);
kt_value tu_op2(kt_graph *g, const char *name, kt_op op, const kt_op_attrs *attrs, kt_value a,
                kt_value b);

/* Attributes for op written as a designated initialiser: TU_ATTRS(KT_OP_MATMUL, .trans_b = 1)
 * is kt_op_defaults(KT_OP_MATMUL) with every attribute matmul lists taken from the
 * initialiser (0 where it names nothing, as tests wrote them before defaults were explicit;
 * but an optional attribute whose valid range excludes 0, like topk_router's n_group, keeps
 * its default there). A struct already made for op is kept as it is. The result is an lvalue (&TU_ATTRS(...)). */
kt_op_attrs *tu_attrs_into(kt_op_attrs *dst, kt_op op, kt_op_attrs given);
#define TU_ATTRS(op, ...) (*tu_attrs_into(&(kt_op_attrs){0}, (op), (kt_op_attrs){__VA_ARGS__}))

/* Fails the test with the call and the library's last error unless it returns KT_OK. */
#define OK(expr)                                                                              \
    do {                                                                                      \
        kt_status s_ = (expr);                                                                \
        if (s_ != KT_OK)                                                                      \
            fail_msg("%s: %s", #expr, kt_last_error());                                       \
    } while (0)

/* A .ktg text compiled into a program (training = 0: forward only), the parser's diagnostics
 * in the failure message; the graph is not kept. */
kt_program *tu_compile_ktg(const char *text, const char *filename, int training);

/* A new directory /tmp/<tag>.XXXXXX (malloc'd path), and its removal with what is in it. */
char *tu_temp_dir(const char *tag);
void tu_remove_tree(const char *dir);

/* Asserts that the status equals `expected` and that the last error message contains
 * every one of the given substrings (NULL-terminated). */
void tu_expect_error(kt_status got, kt_status expected, const char *first, ...);
#define TU_EXPECT_ERROR(got, expected, ...) \
    tu_expect_error((got), (expected), __VA_ARGS__, (const char *)NULL)

#endif
