/* concat, narrow, transpose, reshape: forward against float64 references, backward against
 * finite differences, byte exactness for every dtype (forward and backward), big copies
 * split over threads, in-place reshape, and bad input.
 *
 * One reference serves all checks: for each output element, the input element it comes
 * from, worked out from shapes alone (independently of the library's strides and views). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/support/gradcheck.h"

/* ---- the reference: where each output element comes from ---------------------------------- */

typedef struct shp {
    int ndim;
    int64_t s[KT_MAX_DIMS];
} shp;

static int64_t shp_numel(const shp *a)
{
    int64_t n = 1;
    for (int d = 0; d < a->ndim; d++)
        n *= a->s[d];
    return n;
}

static int64_t shp_flat(const shp *a, const int64_t *idx)
{
    int64_t f = 0;
    for (int d = 0; d < a->ndim; d++)
        f = f * a->s[d] + idx[d];
    return f;
}

static void shp_unflat(const shp *a, int64_t f, int64_t *idx)
{
    for (int d = a->ndim - 1; d >= 0; d--) {
        idx[d] = f % a->s[d];
        f /= a->s[d];
    }
}

/* src_in[k], src_el[k]: the input and element that output element k copies. */
static void source_map(kt_op op, const kt_op_attrs *at, const shp *in, const shp *out,
                       int *src_in, int64_t *src_el)
{
    int64_t n = shp_numel(out);
    for (int64_t k = 0; k < n; k++) {
        int64_t idx[KT_MAX_DIMS] = {0};
        shp_unflat(out, k, idx);
        int i = 0;
        switch (op) {
        case KT_OP_CONCAT:
            while (idx[at->dim] >= in[i].s[at->dim])
                idx[at->dim] -= in[i++].s[at->dim];
            break;
        case KT_OP_NARROW:
            idx[at->dim] += at->start;
            break;
        case KT_OP_TRANSPOSE: {
            int64_t t = idx[at->dim0];
            idx[at->dim0] = idx[at->dim1];
            idx[at->dim1] = t;
            break;
        }
        case KT_OP_RESHAPE:
            src_in[k] = 0;
            src_el[k] = k;
            continue;
        default:
            fail_msg("not a shape op");
        }
        src_in[k] = i;
        src_el[k] = shp_flat(&in[i], idx);
    }
}

static shp shp_of_dt(const gc_dt *t)
{
    shp r = {.ndim = t->ndim};
    memcpy(r.s, t->shape, sizeof r.s);
    return r;
}

static shp shp_of(const kt_tensor *t)
{
    shp r = {.ndim = t->ndim};
    memcpy(r.s, t->shape, sizeof r.s);
    return r;
}

static void ref_generic(kt_op op, const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out)
{
    shp sin[KT_OP_MAX_IN];
    for (int i = 0; i < n_in; i++)
        sin[i] = shp_of_dt(&in[i]);
    shp sout = shp_of_dt(&out[0]);
    int *si = malloc((size_t)(out[0].n + 1) * sizeof *si);
    int64_t *se = malloc((size_t)(out[0].n + 1) * sizeof *se);
    assert_non_null(si);
    assert_non_null(se);
    source_map(op, at, sin, &sout, si, se);
    for (int64_t k = 0; k < out[0].n; k++)
        out[0].d[k] = in[si[k]].d[se[k]];
    free(si);
    free(se);
}

static void ref_concat(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)n_out;
    ref_generic(KT_OP_CONCAT, at, in, n_in, out);
}

static void ref_narrow(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)n_out;
    ref_generic(KT_OP_NARROW, at, in, n_in, out);
}

static void ref_transpose(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out,
                          int n_out)
{
    (void)n_out;
    ref_generic(KT_OP_TRANSPOSE, at, in, n_in, out);
}

static void ref_reshape(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out,
                        int n_out)
{
    (void)n_out;
    ref_generic(KT_OP_RESHAPE, at, in, n_in, out);
}

/* ---- float64 forward + finite-difference backward --------------------------------------- */

static void fill_random_bytes(kt_tensor *t, tu_rng *rng)
{
    unsigned char *p = t->data;
    size_t n = kt_tensor_nbytes(t);
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(tu_rng_next(rng) >> 56);
}

/* Concat of 1, 2 and 5 inputs along each dim of a 3-D and a 4-D shape; the inputs differ
 * along the dim (sizes 1, 3, 2, 4, 1), one case with an empty input. */
static void test_concat(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 1);
    const int64_t bases[2][KT_MAX_DIMS] = {{3, 4, 5, 0}, {2, 3, 2, 3}};
    const int ndims[2] = {3, 4};
    const int counts[3] = {1, 2, 5};
    const int64_t sizes[5] = {1, 3, 2, 4, 1};
    for (int b = 0; b < 2; b++) {
        for (int dim = 0; dim < ndims[b]; dim++) {
            for (int ci = 0; ci < 3; ci++) {
                kt_tensor in[5];
                for (int i = 0; i < counts[ci]; i++) {
                    int64_t s[KT_MAX_DIMS];
                    memcpy(s, bases[b], sizeof s);
                    s[dim] = sizes[i];
                    in[i] = tu_alloc(KT_F32, ndims[b], s);
                    tu_fill_uniform(&in[i], &rng, -3, 3);
                }
                gc_case c = {.op = KT_OP_CONCAT,
                             .attrs = TU_ATTRS(KT_OP_CONCAT, .dim = dim),
                             .in = in,
                             .n_in = counts[ci],
                             .ref = ref_concat,
                             .threads = (dim + ci) % 2 ? 2 : 0,
                             .seed = (uint64_t)(100 * b + 10 * dim + ci)};
                gc_check(&c);
                for (int i = 0; i < counts[ci]; i++)
                    tu_free(&in[i]);
            }
        }
    }
    /* an input that is empty along the dim contributes nothing and gets an empty gradient */
    kt_tensor in[3] = {tu_new(KT_F32, 2, 3), tu_new(KT_F32, 2, 0), tu_new(KT_F32, 2, 4)};
    tu_fill_uniform(&in[0], &rng, -1, 1);
    tu_fill_uniform(&in[2], &rng, -1, 1);
    gc_case c = {.op = KT_OP_CONCAT,
                 .attrs = TU_ATTRS(KT_OP_CONCAT, .dim = 1),
                 .in = in,
                 .n_in = 3,
                 .ref = ref_concat,
                 .seed = 7};
    gc_check(&c);
    for (int i = 0; i < 3; i++)
        tu_free(&in[i]);
    /* the maximum input count */
    kt_tensor many[KT_OP_MAX_IN];
    for (int i = 0; i < KT_OP_MAX_IN; i++) {
        many[i] = tu_new(KT_F32, i + 1, 3);
        tu_fill_uniform(&many[i], &rng, -1, 1);
    }
    gc_case m = {.op = KT_OP_CONCAT, .in = many, .n_in = KT_OP_MAX_IN, .ref = ref_concat,
                 .seed = 8};
    gc_check(&m);
    for (int i = 0; i < KT_OP_MAX_IN; i++)
        tu_free(&many[i]);
}

/* Narrow along each dim: first and last element, the whole dim, an inner range, and empty
 * ranges at both ends. */
static void test_narrow(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 2);
    kt_tensor x = tu_new(KT_F32, 4, 6, 5);
    tu_fill_uniform(&x, &rng, -3, 3);
    for (int dim = 0; dim < 3; dim++) {
        int64_t n = x.shape[dim];
        const int64_t ranges[][2] = {{0, 1}, {n - 1, 1}, {0, n}, {1, n - 2}, {0, 0}, {n, 0}};
        for (size_t r = 0; r < sizeof ranges / sizeof ranges[0]; r++) {
            gc_case c = {.op = KT_OP_NARROW,
                         .attrs = TU_ATTRS(KT_OP_NARROW, .dim = dim, .start = ranges[r][0],
                                           .length = ranges[r][1]),
                         .in = &x,
                         .n_in = 1,
                         .ref = ref_narrow,
                         .threads = r % 2 ? 2 : 0,
                         .seed = (uint64_t)(10 * dim + (int)r)};
            gc_check(&c);
        }
    }
    tu_free(&x);
    kt_tensor v = tu_new(KT_F32, 9);
    tu_fill_uniform(&v, &rng, -1, 1);
    gc_case c = {.op = KT_OP_NARROW,
                 .attrs = TU_ATTRS(KT_OP_NARROW, .start = 8, .length = 1),
                 .in = &v,
                 .n_in = 1,
                 .ref = ref_narrow,
                 .seed = 3};
    gc_check(&c);
    tu_free(&v);
}

/* Every pair of dims of a 4-D tensor (both orders, and a dim with itself), and 1-D to 3-D. */
static void test_transpose(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 3);
    kt_tensor x = tu_new(KT_F32, 2, 3, 4, 5);
    tu_fill_uniform(&x, &rng, -3, 3);
    for (int d0 = 0; d0 < 4; d0++) {
        for (int d1 = 0; d1 < 4; d1++) {
            gc_case c = {.op = KT_OP_TRANSPOSE,
                         .attrs = TU_ATTRS(KT_OP_TRANSPOSE, .dim0 = d0, .dim1 = d1),
                         .in = &x,
                         .n_in = 1,
                         .ref = ref_transpose,
                         .threads = (d0 + d1) % 2 ? 2 : 0,
                         .seed = (uint64_t)(4 * d0 + d1)};
            gc_check(&c);
        }
    }
    tu_free(&x);
    const int64_t shapes[3][3] = {{7, 0, 0}, {6, 7, 0}, {3, 1, 5}};
    for (int nd = 1; nd <= 3; nd++) {
        kt_tensor t = tu_alloc(KT_F32, nd, shapes[nd - 1]);
        tu_fill_uniform(&t, &rng, -1, 1);
        gc_case c = {.op = KT_OP_TRANSPOSE,
                     .attrs = TU_ATTRS(KT_OP_TRANSPOSE, .dim0 = 0, .dim1 = nd - 1),
                     .in = &t,
                     .n_in = 1,
                     .ref = ref_transpose,
                     .seed = (uint64_t)(50 + nd)};
        gc_check(&c);
        tu_free(&t);
    }
}

static void test_reshape(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 4);
    kt_tensor x = tu_new(KT_F32, 3, 4, 5);
    tu_fill_uniform(&x, &rng, -3, 3);
    const struct {
        int ndim;
        int64_t shape[KT_MAX_DIMS];
    } cases[] = {{2, {-1, 5}},     {2, {12, -1}},   {3, {4, -1, 3}}, {1, {-1}},
                 {1, {60}},        {4, {2, 3, 2, 5}}, {4, {1, -1, 1, 1}}, {3, {5, 4, 3}}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        gc_case c = {.op = KT_OP_RESHAPE, .in = &x, .n_in = 1, .ref = ref_reshape,
                     .threads = k % 2 ? 2 : 0, .seed = (uint64_t)k};
        c.attrs.ndim = cases[k].ndim;
        memcpy(c.attrs.shape, cases[k].shape, sizeof c.attrs.shape);
        gc_check(&c);
    }
    tu_free(&x);
    /* a one-element tensor to a scalar and back */
    kt_tensor one = tu_new(KT_F32, 1, 1);
    tu_set(&one, 0, 2.5);
    gc_case s = {.op = KT_OP_RESHAPE, .in = &one, .n_in = 1, .ref = ref_reshape, .seed = 9};
    gc_check(&s);
    tu_free(&one);
    kt_tensor sc = tu_alloc(KT_F32, 0, NULL);
    tu_set(&sc, 0, -1.5);
    gc_case u = {.op = KT_OP_RESHAPE,
                 .attrs = TU_ATTRS(KT_OP_RESHAPE, .ndim = 2, .shape = {1, -1}),
                 .in = &sc,
                 .n_in = 1,
                 .ref = ref_reshape,
                 .seed = 10};
    gc_check(&u);
    tu_free(&sc);
}

/* ---- byte exactness: every dtype, forward and backward ---------------------------------- */

typedef struct op_case {
    kt_op op;
    kt_op_attrs attrs;
    int n_in;
    int ndim;
    int64_t shapes[3][KT_MAX_DIMS];
} op_case;

/* Runs forward and (for float dtypes) backward on random bytes and compares every byte with
 * the source map; gradients not in the map must be zero, skipped ones must stay untouched. */
static void check_exact(const op_case *oc_in, kt_dtype dtype, int threads, tu_rng *rng)
{
    op_case stamped = *oc_in; /* the attributes as the case wrote them, made for its op */
    tu_attrs_into(&stamped.attrs, oc_in->op, oc_in->attrs);
    const op_case *oc = &stamped;
    const char *name = kt_op_name(oc->op);
    const size_t es = kt_dtype_size(dtype);
    kt_tensor in[3], gin[3], out, gout;
    for (int i = 0; i < oc->n_in; i++) {
        in[i] = tu_alloc(dtype, oc->ndim, oc->shapes[i]);
        fill_random_bytes(&in[i], rng);
    }
    assert_int_equal(kt_op_infer(oc->op, &oc->attrs, in, oc->n_in, &out, 1), KT_OK);
    out = tu_alloc(out.dtype, out.ndim, out.shape);
    assert_int_equal(out.dtype, dtype);
    kt_threadpool *pool = NULL;
    if (threads > 0)
        assert_int_equal(kt_threadpool_create(threads, &pool), KT_OK);
    kt_exec ex = {.pool = pool};
    if (kt_op_forward(oc->op, &oc->attrs, in, oc->n_in, &out, 1, &ex) != KT_OK)
        fail_msg("%s %s forward: %s", name, kt_dtype_name(dtype), kt_last_error());

    shp sin[3], sout = shp_of(&out);
    for (int i = 0; i < oc->n_in; i++)
        sin[i] = shp_of(&in[i]);
    int64_t n = kt_tensor_numel(&out);
    int *si = malloc((size_t)(n + 1) * sizeof *si);
    int64_t *se = malloc((size_t)(n + 1) * sizeof *se);
    assert_non_null(si);
    assert_non_null(se);
    source_map(oc->op, &oc->attrs, sin, &sout, si, se);
    for (int64_t k = 0; k < n; k++)
        if (memcmp((char *)out.data + k * (int64_t)es, (char *)in[si[k]].data + se[k] * (int64_t)es,
                   es) != 0)
            fail_msg("%s %s (%d threads): output element %lld is not input %d element %lld",
                     name, kt_dtype_name(dtype), threads, (long long)k, si[k], (long long)se[k]);

    int integer = dtype == KT_I32 || dtype == KT_I64;
    memset(&gout, 0, sizeof gout);
    if (integer) {
        /* no gradient flows: an empty request succeeds, a real one is refused */
        memset(gin, 0, sizeof gin);
        gout = out;
        gout.data = NULL;
        assert_int_equal(kt_op_backward(oc->op, &oc->attrs, in, oc->n_in, &out, 1, &gout, gin,
                                        &ex),
                         KT_OK);
        gin[0] = tu_clone(&in[0]);
        TU_EXPECT_ERROR(kt_op_backward(oc->op, &oc->attrs, in, oc->n_in, &out, 1, &gout, gin,
                                       &ex),
                        KT_EINVAL, name, "input 0");
        tu_free(&gin[0]);
    } else {
        gout = tu_alloc(dtype, out.ndim, out.shape);
        fill_random_bytes(&gout, rng);
        /* every input but the second asks for its gradient; garbage shows unwritten bytes */
        for (int i = 0; i < oc->n_in; i++) {
            if (i == 1) {
                memset(&gin[i], 0, sizeof gin[i]);
                continue;
            }
            gin[i] = tu_alloc(dtype, in[i].ndim, in[i].shape);
            memset(gin[i].data, 0xa5, kt_tensor_nbytes(&gin[i]));
        }
        if (kt_op_backward(oc->op, &oc->attrs, in, oc->n_in, &out, 1, &gout, gin, &ex) != KT_OK)
            fail_msg("%s %s backward: %s", name, kt_dtype_name(dtype), kt_last_error());
        /* expected: gout scattered back through the map, zero elsewhere */
        for (int i = 0; i < oc->n_in; i++) {
            if (gin[i].data == NULL)
                continue;
            size_t bytes = kt_tensor_nbytes(&in[i]);
            unsigned char *want = calloc(1, bytes + 1);
            assert_non_null(want);
            for (int64_t k = 0; k < n; k++)
                if (si[k] == i)
                    memcpy(want + se[k] * (int64_t)es, (char *)gout.data + k * (int64_t)es, es);
            if (memcmp(want, gin[i].data, bytes) != 0)
                fail_msg("%s %s (%d threads): gradient of input %d is not grad_out scattered "
                         "back", name, kt_dtype_name(dtype), threads, i);
            free(want);
            tu_free(&gin[i]);
        }
        tu_free(&gout);
    }
    free(si);
    free(se);
    kt_threadpool_destroy(pool);
    tu_free(&out);
    for (int i = 0; i < oc->n_in; i++)
        tu_free(&in[i]);
}

static const op_case small_cases[] = {
    {KT_OP_CONCAT, {.dim = 0}, 3, 2, {{2, 5}, {1, 5}, {3, 5}}},
    {KT_OP_CONCAT, {.dim = 1}, 3, 3, {{2, 3, 4}, {2, 1, 4}, {2, 2, 4}}},
    {KT_OP_CONCAT, {.dim = 2}, 2, 3, {{2, 3, 1}, {2, 3, 5}}},
    {KT_OP_NARROW, {.dim = 1, .start = 2, .length = 3}, 1, 3, {{3, 7, 2}}},
    {KT_OP_NARROW, {.dim = 0, .start = 0, .length = 2}, 1, 2, {{5, 3}}},
    {KT_OP_NARROW, {.dim = 3, .start = 4, .length = 1}, 1, 4, {{2, 1, 3, 5}}},
    {KT_OP_TRANSPOSE, {.dim0 = 0, .dim1 = 1}, 1, 2, {{5, 7}}},
    {KT_OP_TRANSPOSE, {.dim0 = 1, .dim1 = 3}, 1, 4, {{2, 3, 4, 5}}},
    {KT_OP_TRANSPOSE, {.dim0 = 0, .dim1 = 2}, 1, 3, {{3, 4, 2}}},
    {KT_OP_RESHAPE, {.ndim = 2, .shape = {-1, 6}}, 1, 3, {{2, 3, 4}}},
};

static void test_all_dtypes_exact(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 5);
    for (int d = 0; d < KT_DTYPE_COUNT; d++)
        for (size_t k = 0; k < sizeof small_cases / sizeof small_cases[0]; k++)
            for (int threads = 0; threads <= 3; threads += 3)
                check_exact(&small_cases[k], (kt_dtype)d, threads, &rng);
}

/* Large enough that the copies are split over the pool, with rows that do not divide
 * evenly among the threads. */
static const op_case big_cases[] = {
    {KT_OP_CONCAT, {.dim = 0}, 3, 2, {{3001, 97}, {1, 97}, {2999, 97}}},
    {KT_OP_CONCAT, {.dim = 1}, 2, 3, {{37, 301, 11}, {37, 299, 11}}},
    {KT_OP_CONCAT, {.dim = 2}, 3, 3, {{113, 67, 7}, {113, 67, 29}, {113, 67, 1}}},
    {KT_OP_NARROW, {.dim = 1, .start = 17, .length = 1000}, 1, 2, {{301, 1031}}},
    {KT_OP_NARROW, {.dim = 0, .start = 1, .length = 40000}, 1, 2, {{40003, 9}}},
    {KT_OP_TRANSPOSE, {.dim0 = 0, .dim1 = 1}, 1, 2, {{517, 611}}},
    {KT_OP_TRANSPOSE, {.dim0 = 0, .dim1 = 2}, 1, 3, {{61, 37, 53}}},
    {KT_OP_TRANSPOSE, {.dim0 = 1, .dim1 = 2}, 1, 4, {{3, 61, 59, 31}}},
    {KT_OP_RESHAPE, {.ndim = 2, .shape = {-1, 1000}}, 1, 3, {{10, 300, 100}}},
};

static void test_big_threaded(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 6);
    const kt_dtype dtypes[] = {KT_F32, KT_BF16, KT_I64};
    const int threads[] = {1, 2, 4};
    for (size_t k = 0; k < sizeof big_cases / sizeof big_cases[0]; k++)
        for (size_t t = 0; t < 3; t++)
            check_exact(&big_cases[k], dtypes[(k + t) % 3], threads[t], &rng);
    /* and one finite-difference check of a threaded large case, by probes */
    kt_tensor in[2] = {tu_new(KT_F32, 300, 257), tu_new(KT_F32, 300, 301)};
    tu_fill_uniform(&in[0], &rng, -1, 1);
    tu_fill_uniform(&in[1], &rng, -1, 1);
    gc_case c = {.op = KT_OP_CONCAT,
                 .attrs = TU_ATTRS(KT_OP_CONCAT, .dim = 1),
                 .in = in,
                 .n_in = 2,
                 .ref = ref_concat,
                 .probes = 12,
                 .threads = 4,
                 .seed = 11};
    gc_check(&c);
    tu_free(&in[0]);
    tu_free(&in[1]);
}

/* Integer tensors beyond float precision come through unchanged (ids are copied, not
 * converted). */
static void test_integer_values(void **state)
{
    (void)state;
    kt_tensor a = tu_new(KT_I64, 2, 3), b = tu_new(KT_I64, 2, 1);
    int64_t *pa = a.data, *pb = b.data;
    for (int i = 0; i < 6; i++)
        pa[i] = INT64_MAX - i;
    pb[0] = INT64_MIN;
    pb[1] = (int64_t)1 << 62 | 1;
    kt_tensor in[2] = {a, b}, out = tu_new(KT_I64, 2, 4);
    kt_op_attrs at = TU_ATTRS(KT_OP_CONCAT, .dim = 1);
    assert_int_equal(kt_op_forward(KT_OP_CONCAT, &at, in, 2, &out, 1, NULL), KT_OK);
    const int64_t *po = out.data;
    const int64_t want[8] = {INT64_MAX, INT64_MAX - 1, INT64_MAX - 2, INT64_MIN,
                             INT64_MAX - 3, INT64_MAX - 4, INT64_MAX - 5, pb[1]};
    for (int i = 0; i < 8; i++)
        assert_true(po[i] == want[i]);
    kt_tensor tr = tu_new(KT_I64, 4, 2);
    kt_op_attrs tat = TU_ATTRS(KT_OP_TRANSPOSE, .dim0 = 0, .dim1 = 1);
    assert_int_equal(kt_op_forward(KT_OP_TRANSPOSE, &tat, &out, 1, &tr, 1, NULL), KT_OK);
    const int64_t *pt = tr.data;
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 2; c++)
            assert_true(pt[r * 2 + c] == want[c * 4 + r]);
    tu_free(&a), tu_free(&b), tu_free(&out), tu_free(&tr);
}

/* reshape runs with the output on the input's memory (the planner's in-place case), forward
 * and backward. */
static void test_reshape_inplace(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 12);
    kt_tensor x = tu_new(KT_BF16, 4, 6), keep;
    fill_random_bytes(&x, &rng);
    keep = tu_clone(&x);
    kt_op_attrs at = TU_ATTRS(KT_OP_RESHAPE, .ndim = 3, .shape = {2, -1, 3});
    kt_tensor out;
    assert_int_equal(kt_op_infer(KT_OP_RESHAPE, &at, &x, 1, &out, 1), KT_OK);
    assert_int_equal(out.ndim, 3);
    assert_true(out.shape[0] == 2 && out.shape[1] == 4 && out.shape[2] == 3);
    out.data = x.data;
    assert_int_equal(kt_op_forward(KT_OP_RESHAPE, &at, &x, 1, &out, 1, NULL), KT_OK);
    assert_memory_equal(out.data, keep.data, kt_tensor_nbytes(&x));
    kt_tensor g = x; /* the gradient written over grad_out's own memory */
    g.data = out.data;
    assert_int_equal(kt_op_backward(KT_OP_RESHAPE, &at, &x, 1, &out, 1, &out, &g, NULL), KT_OK);
    assert_memory_equal(g.data, keep.data, kt_tensor_nbytes(&x));
    tu_free(&x), tu_free(&keep);
}

static void test_table_rows(void **state)
{
    (void)state;
    int mn, mx, no;
    assert_int_equal(kt_op_arity(KT_OP_CONCAT, &mn, &mx, &no), KT_OK);
    assert_int_equal(mn, 1);
    assert_int_equal(mx, KT_OP_MAX_IN);
    assert_int_equal(no, 1);
    const kt_op single[] = {KT_OP_NARROW, KT_OP_TRANSPOSE, KT_OP_RESHAPE};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kt_op_arity(single[i], &mn, &mx, &no), KT_OK);
        assert_int_equal(mn, 1);
        assert_int_equal(mx, 1);
        assert_int_equal(no, 1);
    }
    kt_tensor x;
    assert_int_equal(kt_tensor_init(&x, NULL, KT_F32, 2, TU_SHAPE(4, 5)), KT_OK);
    assert_true(kt_op_flops(KT_OP_TRANSPOSE, NULL, &x, 1) == 0.0);
    assert_int_equal(kt_op_scratch_bytes(KT_OP_CONCAT, NULL, &x, 1, 0), 0);
    assert_int_equal(kt_op_scratch_bytes(KT_OP_CONCAT, NULL, &x, 1, 1), 0);
}

/* ---- bad input ------------------------------------------------------------------------------ */

/* A negative dim counts from the end: concat, narrow and transpose of 4-d tensors (MLA's
 * [B,T,heads,dim] split and joined along -1) give the bytes of the positive dim, forward and
 * backward. */
static void run_fb(kt_op op, const kt_op_attrs *at, const kt_tensor *in, int n_in, kt_tensor *y,
                   kt_tensor *gx)
{
    kt_tensor desc;
    assert_int_equal(kt_op_infer(op, at, in, n_in, &desc, 1), KT_OK);
    *y = tu_alloc(desc.dtype, desc.ndim, desc.shape);
    kt_tensor g = tu_alloc(desc.dtype, desc.ndim, desc.shape);
    for (int64_t i = 0; i < kt_tensor_numel(&g); i++)
        tu_set(&g, i, (double)(i % 7) - 3.0);
    for (int i = 0; i < n_in; i++)
        gx[i] = tu_alloc(in[i].dtype, in[i].ndim, in[i].shape);
    assert_int_equal(kt_op_forward(op, at, in, n_in, y, 1, NULL), KT_OK);
    assert_int_equal(kt_op_backward(op, at, in, n_in, y, 1, &g, gx, NULL), KT_OK);
    tu_free(&g);
}

static void expect_same_run(kt_op op, const kt_op_attrs *neg, const kt_op_attrs *pos,
                            const kt_tensor *in, int n_in)
{
    kt_tensor y0, y1, g0[2], g1[2];
    run_fb(op, neg, in, n_in, &y0, g0);
    run_fb(op, pos, in, n_in, &y1, g1);
    assert_true(tu_bitwise_equal(&y0, &y1));
    for (int i = 0; i < n_in; i++) {
        assert_true(tu_bitwise_equal(&g0[i], &g1[i]));
        tu_free(&g0[i]), tu_free(&g1[i]);
    }
    tu_free(&y0), tu_free(&y1);
}

static void test_negative_dims(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 9);
    kt_tensor a = tu_new(KT_F32, 2, 3, 4, 5), b = tu_new(KT_F32, 2, 3, 4, 5);
    tu_fill_uniform(&a, &rng, -1, 1);
    tu_fill_uniform(&b, &rng, -1, 1);
    const kt_tensor ab[2] = {a, b};
    for (int d = -4; d < 0; d++) {
        kt_op_attrs cn = TU_ATTRS(KT_OP_CONCAT, .dim = d), cp = TU_ATTRS(KT_OP_CONCAT, .dim = d + 4);
        expect_same_run(KT_OP_CONCAT, &cn, &cp, ab, 2);
        kt_op_attrs nn = TU_ATTRS(KT_OP_NARROW, .dim = d, .start = 1, .length = 1);
        kt_op_attrs np = TU_ATTRS(KT_OP_NARROW, .dim = d + 4, .start = 1, .length = 1);
        expect_same_run(KT_OP_NARROW, &nn, &np, &a, 1);
        kt_op_attrs tn = TU_ATTRS(KT_OP_TRANSPOSE, .dim0 = d, .dim1 = -1);
        kt_op_attrs tp = TU_ATTRS(KT_OP_TRANSPOSE, .dim0 = d + 4, .dim1 = 3);
        expect_same_run(KT_OP_TRANSPOSE, &tn, &tp, &a, 1);
    }
    tu_free(&a), tu_free(&b);
}

static void test_bad_input(void **state)
{
    (void)state;
    kt_tensor a = tu_new(KT_F32, 4, 3), b = tu_new(KT_F32, 4, 2), c = tu_new(KT_F32, 5, 3);
    kt_tensor h = tu_new(KT_BF16, 4, 3), v = tu_new(KT_F32, 4), x = tu_new(KT_F32, 2, 8);
    kt_tensor s = tu_alloc(KT_F32, 0, NULL), out;
    kt_op_attrs at = TU_ATTRS(KT_OP_CONCAT, .dim = 1);

    /* concat */
    kt_tensor in3[3] = {a, b, c};
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_CONCAT, &at, in3, 3, &out, 1), KT_EINVAL,
                    "concat: input 2 dimension 0 must be 4, got f32[5,3]");
    kt_tensor inh[2] = {a, h};
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_CONCAT, &at, inh, 2, &out, 1), KT_EINVAL, "concat",
                    "input 1", "bf16");
    kt_tensor inv[2] = {a, v};
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_CONCAT, &at, inv, 2, &out, 1), KT_EINVAL, "concat",
                    "input 1", "2 dimensions");
    kt_op_attrs far = TU_ATTRS(KT_OP_CONCAT, .dim = 2);
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_CONCAT, &far, in3, 2, &out, 1), KT_EINVAL, "concat",
                    "dim 2");
    kt_op_attrs neg = TU_ATTRS(KT_OP_CONCAT, .dim = -3);
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_CONCAT, &neg, in3, 2, &out, 1), KT_EINVAL, "concat",
                    "dim -3 outside -2..1");
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_CONCAT, &at, &s, 1, &out, 1), KT_EINVAL, "concat",
                    "input 0");
    kt_tensor nine[KT_OP_MAX_IN + 1];
    for (int i = 0; i <= KT_OP_MAX_IN; i++)
        nine[i] = a;
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_CONCAT, &at, nine, KT_OP_MAX_IN + 1, &out, 1),
                    KT_EINVAL, "concat", "1 to 8 inputs", "got 9");
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_CONCAT, &at, nine, 0, &out, 1), KT_EINVAL, "concat",
                    "got 0");
    kt_tensor wrong = tu_new(KT_F32, 4, 6);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CONCAT, &at, in3, 2, &wrong, 1, NULL), KT_EINVAL,
                    "concat", "output 0", "f32[4,5]", "f32[4,6]");

    /* narrow */
    kt_op_attrs nr = TU_ATTRS(KT_OP_NARROW, .dim = 1, .start = 3, .length = 6);
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_NARROW, &nr, &x, 1, &out, 1), KT_EINVAL,
                    "narrow: range [3, 9) outside dim 1 of size 8");
    nr = TU_ATTRS(KT_OP_NARROW, .dim = 1, .start = -1, .length = 2);
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_NARROW, &nr, &x, 1, &out, 1), KT_EINVAL, "narrow",
                    "range [-1, 1)");
    nr = TU_ATTRS(KT_OP_NARROW, .dim = 0, .start = 1, .length = -1);
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_NARROW, &nr, &x, 1, &out, 1), KT_EINVAL, "narrow",
                    "range", "dim 0");
    nr = TU_ATTRS(KT_OP_NARROW, .dim = 2, .start = 0, .length = 1);
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_NARROW, &nr, &x, 1, &out, 1), KT_EINVAL, "narrow",
                    "dim 2");
    nr = TU_ATTRS(KT_OP_NARROW, .dim = -3, .start = 0, .length = 1);
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_NARROW, &nr, &x, 1, &out, 1), KT_EINVAL, "narrow",
                    "dim -3 outside -2..1");
    nr = TU_ATTRS(KT_OP_NARROW, .dim = 0, .start = 0, .length = 1);
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_NARROW, &nr, &s, 1, &out, 1), KT_EINVAL, "narrow", "x");
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_NARROW, &nr, in3, 2, &out, 1), KT_EINVAL, "narrow",
                    "1 input");

    /* transpose */
    kt_op_attrs tr = TU_ATTRS(KT_OP_TRANSPOSE, .dim0 = 0, .dim1 = 2);
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_TRANSPOSE, &tr, &x, 1, &out, 1), KT_EINVAL, "transpose",
                    "dim1 2");
    tr = TU_ATTRS(KT_OP_TRANSPOSE, .dim0 = -3, .dim1 = 0);
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_TRANSPOSE, &tr, &x, 1, &out, 1), KT_EINVAL, "transpose",
                    "dim0 -3 outside -2..1");
    tr = TU_ATTRS(KT_OP_TRANSPOSE, .dim0 = 0);
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_TRANSPOSE, &tr, &s, 1, &out, 1), KT_EINVAL, "transpose",
                    "x");

    /* reshape */
    kt_op_attrs rs = TU_ATTRS(KT_OP_RESHAPE, .ndim = 2, .shape = {-1, -1});
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_RESHAPE, &rs, &x, 1, &out, 1), KT_EINVAL, "reshape",
                    "-1");
    rs = TU_ATTRS(KT_OP_RESHAPE, .ndim = 2, .shape = {3, 5});
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_RESHAPE, &rs, &x, 1, &out, 1), KT_EINVAL, "reshape",
                    "16 elements", "15");
    rs = TU_ATTRS(KT_OP_RESHAPE, .ndim = 2, .shape = {3, -1});
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_RESHAPE, &rs, &x, 1, &out, 1), KT_EINVAL, "reshape",
                    "infer", "16");
    rs = TU_ATTRS(KT_OP_RESHAPE, .ndim = 2, .shape = {-4, -4});
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_RESHAPE, &rs, &x, 1, &out, 1), KT_EINVAL, "reshape",
                    "negative");
    rs = TU_ATTRS(KT_OP_RESHAPE, .ndim = 5, .shape = {16});
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_RESHAPE, &rs, &x, 1, &out, 1), KT_EINVAL, "reshape",
                    "ndim 5");
    /* a gradient of the wrong dtype */
    kt_op_attrs ok = TU_ATTRS(KT_OP_RESHAPE, .ndim = 1, .shape = {-1});
    kt_tensor flat = tu_new(KT_F32, 16), gbad = tu_new(KT_BF16, 2, 8);
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_RESHAPE, &ok, &x, 1, &flat, 1, &flat, &gbad, NULL),
                    KT_EINVAL, "reshape", "input gradient 0", "bf16[2,8]");
    tu_free(&flat), tu_free(&gbad);

    tu_free(&a), tu_free(&b), tu_free(&c), tu_free(&h), tu_free(&v), tu_free(&x), tu_free(&s);
    tu_free(&wrong);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_concat),          cmocka_unit_test(test_narrow),
        cmocka_unit_test(test_transpose),       cmocka_unit_test(test_reshape),
        cmocka_unit_test(test_all_dtypes_exact), cmocka_unit_test(test_big_threaded),
        cmocka_unit_test(test_integer_values),  cmocka_unit_test(test_reshape_inplace),
        cmocka_unit_test(test_table_rows),      cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_negative_dims),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
