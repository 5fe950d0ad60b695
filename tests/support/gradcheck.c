/* Op checks against float64 references (see gradcheck.h). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "lib/ops/op_desc.h"
#include "tests/support/gradcheck.h"

static int is_float(kt_dtype d) { return d == KT_F32 || d == KT_BF16 || d == KT_F16; }

/* Input i gets a gradient: a float that the op's row does not mark as taking none (a
 * selection-only bias is a float that takes none). */
static int takes_grad(kt_op op, const kt_tensor *in, int i)
{
    return is_float(in[i].dtype) && !(kt__op_get(op)->no_grad_in & (1u << i));
}

static gc_dt dt_alloc(int ndim, const int64_t *shape)
{
    gc_dt t = {.ndim = ndim, .n = 1};
    for (int d = 0; d < ndim; d++) {
        t.shape[d] = shape[d];
        t.n *= shape[d];
    }
    t.d = calloc((size_t)(t.n ? t.n : 1), sizeof(double));
    assert_non_null(t.d);
    return t;
}

static gc_dt dt_from(const kt_tensor *t)
{
    gc_dt r = dt_alloc(t->ndim, t->shape);
    for (int64_t i = 0; i < r.n; i++)
        r.d[i] = tu_get(t, i);
    return r;
}

/* Results of one libkt run: outputs and input gradients. */
typedef struct run_result {
    kt_tensor out[KT_OP_MAX_OUT];
    kt_tensor gin[KT_OP_MAX_IN];
    int n_out;
} run_result;

static void result_free(run_result *r, int n_in)
{
    for (int i = 0; i < r->n_out; i++)
        tu_free(&r->out[i]);
    for (int i = 0; i < n_in; i++)
        tu_free(&r->gin[i]);
}

static void *scratch_for(const gc_case *c, const kt_tensor *in, size_t *bytes)
{
    size_t f = kt_op_scratch_bytes(c->op, &c->attrs, in, c->n_in, 0);
    size_t b = kt_op_scratch_bytes(c->op, &c->attrs, in, c->n_in, 1);
    *bytes = f > b ? f : b;
    if (*bytes == 0)
        return NULL;
    void *p = NULL;
    assert_int_equal(posix_memalign(&p, 64, *bytes), 0);
    return p;
}

/* Forward with `in`, then backward with `gout` (NULL: fresh random grads written there). */
static void run_op(const gc_case *c, const kt_tensor *in, kt_tensor *gout, int threads,
                   run_result *r)
{
    memset(r, 0, sizeof *r);
    int min_in, max_in, n_out;
    assert_int_equal(kt_op_arity(c->op, &min_in, &max_in, &n_out), KT_OK);
    r->n_out = n_out;
    kt_status s = kt_op_infer(c->op, &c->attrs, in, c->n_in, r->out, n_out);
    if (s != KT_OK)
        fail_msg("%s infer: %s", kt_op_name(c->op), kt_last_error());
    for (int i = 0; i < n_out; i++)
        r->out[i] = tu_alloc(r->out[i].dtype, r->out[i].ndim, r->out[i].shape);
    kt_threadpool *pool = NULL;
    if (threads > 0)
        assert_int_equal(kt_threadpool_create(threads, &pool), KT_OK);
    kt_exec ex = {.pool = pool};
    ex.scratch = scratch_for(c, in, &ex.scratch_bytes);
    s = kt_op_forward(c->op, &c->attrs, in, c->n_in, r->out, n_out, &ex);
    if (s != KT_OK)
        fail_msg("%s forward: %s", kt_op_name(c->op), kt_last_error());
    for (int i = 0; i < c->n_in; i++) {
        if (takes_grad(c->op, in, i))
            r->gin[i] = tu_alloc(in[i].dtype, in[i].ndim, in[i].shape);
        else
            r->gin[i] = (kt_tensor){0};
    }
    s = kt_op_backward(c->op, &c->attrs, in, c->n_in, r->out, n_out, gout, r->gin, &ex);
    if (s != KT_OK)
        fail_msg("%s backward: %s", kt_op_name(c->op), kt_last_error());
    free(ex.scratch);
    kt_threadpool_destroy(pool);
}

/* grad_out: random normal for float outputs (in the output's dtype), absent for integer
 * ones. */
static void make_gout(const gc_case *c, kt_tensor *gout, tu_rng *rng)
{
    int n_out;
    kt_tensor shapes[KT_OP_MAX_OUT];
    assert_int_equal(kt_op_arity(c->op, NULL, NULL, &n_out), KT_OK);
    assert_int_equal(kt_op_infer(c->op, &c->attrs, c->in, c->n_in, shapes, n_out), KT_OK);
    for (int i = 0; i < n_out; i++) {
        if (!is_float(shapes[i].dtype)) {
            gout[i] = (kt_tensor){0};
            gout[i].dtype = shapes[i].dtype;
            gout[i].ndim = shapes[i].ndim;
            memcpy(gout[i].shape, shapes[i].shape, sizeof gout[i].shape);
            continue;
        }
        gout[i] = tu_alloc(shapes[i].dtype, shapes[i].ndim, shapes[i].shape);
        for (int64_t k = 0; k < kt_tensor_numel(&gout[i]); k++)
            tu_set(&gout[i], k, tu_rng_normal(rng));
    }
}

/* L = sum over float outputs of gout . ref_out(in) */
static double ref_loss(const gc_case *c, gc_dt *din, const run_result *shapes,
                       const kt_tensor *gout)
{
    gc_dt dout[KT_OP_MAX_OUT];
    for (int i = 0; i < shapes->n_out; i++)
        dout[i] = dt_alloc(shapes->out[i].ndim, shapes->out[i].shape);
    c->ref(&c->attrs, din, c->n_in, dout, shapes->n_out);
    double loss = 0.0;
    for (int i = 0; i < shapes->n_out; i++) {
        if (gout[i].data != NULL)
            for (int64_t k = 0; k < dout[i].n; k++)
                loss += tu_get(&gout[i], k) * dout[i].d[k];
        free(dout[i].d);
    }
    return loss;
}

void gc_check(const gc_case *c_in)
{
    gc_case stamped = *c_in; /* the attributes as the test wrote them, made for the op */
    tu_attrs_into(&stamped.attrs, c_in->op, c_in->attrs);
    const gc_case *c = &stamped;
    const double fwd_tol = c->fwd_tol > 0 ? c->fwd_tol : 1e-5;
    const double grad_tol = c->grad_tol > 0 ? c->grad_tol : 1e-4;
    const char *name = kt_op_name(c->op);
    tu_rng rng;
    tu_rng_seed(&rng, c->seed + 17);

    kt_tensor gout[KT_OP_MAX_OUT];
    make_gout(c, gout, &rng);
    run_result r;
    run_op(c, c->in, gout, c->threads, &r);

    gc_dt din[KT_OP_MAX_IN];
    for (int i = 0; i < c->n_in; i++)
        din[i] = dt_from(&c->in[i]);

    /* forward against the reference */
    gc_dt dout[KT_OP_MAX_OUT];
    for (int i = 0; i < r.n_out; i++)
        dout[i] = dt_alloc(r.out[i].ndim, r.out[i].shape);
    c->ref(&c->attrs, din, c->n_in, dout, r.n_out);
    for (int i = 0; i < r.n_out; i++) {
        double scale = 1e-6, err = 0.0;
        for (int64_t k = 0; k < dout[i].n; k++)
            scale = fmax(scale, fabs(dout[i].d[k]));
        for (int64_t k = 0; k < dout[i].n; k++) {
            double d = fabs(tu_get(&r.out[i], k) - dout[i].d[k]);
            err = isnan(d) ? INFINITY : fmax(err, d);
        }
        int exact = !is_float(r.out[i].dtype);
        if (exact ? err != 0.0 : err / scale > fwd_tol)
            fail_msg("%s output %d: relative error %.3g against the float64 reference "
                     "(tolerance %.3g)", name, i, err / scale, exact ? 0.0 : fwd_tol);
        free(dout[i].d);
    }

    /* each float input's gradient against central differences */
    for (int i = 0; i < c->n_in; i++) {
        if (!takes_grad(c->op, c->in, i))
            continue;
        int64_t n = din[i].n;
        int64_t probes = c->probes > 0 && c->probes < n ? c->probes : n;
        double scale = 1e-3, err = 0.0;
        int64_t worst = -1;
        double worst_fd = 0, worst_kt = 0;
        for (int64_t p = 0; p < probes; p++) {
            int64_t k = probes == n ? p : (int64_t)(tu_rng_next(&rng) % (uint64_t)n);
            double x = din[i].d[k];
            double h = 1e-6 * fmax(1.0, fabs(x));
            din[i].d[k] = x + h;
            double lp = ref_loss(c, din, &r, gout);
            din[i].d[k] = x - h;
            double lm = ref_loss(c, din, &r, gout);
            din[i].d[k] = x;
            double fd = (lp - lm) / (2 * h);
            double got = tu_get(&r.gin[i], k);
            scale = fmax(scale, fabs(fd));
            double d = fabs(got - fd);
            if (isnan(d) || d > err) {
                err = isnan(d) ? INFINITY : d;
                worst = k;
                worst_fd = fd;
                worst_kt = got;
            }
        }
        if (err / scale > grad_tol)
            fail_msg("%s: gradient of input %d: relative error %.3g against finite differences "
                     "(tolerance %.3g); worst element %lld: kernel %.9g, float64 FD %.9g",
                     name, i, err / scale, grad_tol, (long long)worst, worst_kt, worst_fd);
    }
    for (int i = 0; i < c->n_in; i++)
        free(din[i].d);
    for (int i = 0; i < r.n_out; i++)
        tu_free(&gout[i]);
    result_free(&r, c->n_in);
}

void gc_check_lowp(const gc_case *c_in, kt_dtype dtype, double tol)
{
    gc_case stamped = *c_in; /* the attributes as the test wrote them, made for the op */
    tu_attrs_into(&stamped.attrs, c_in->op, c_in->attrs);
    const gc_case *c = &stamped;
    tu_rng rng;
    tu_rng_seed(&rng, c->seed + 29);
    kt_tensor gout[KT_OP_MAX_OUT], gout_lp[KT_OP_MAX_OUT], in_lp[KT_OP_MAX_IN];
    make_gout(c, gout, &rng);
    for (int i = 0; i < c->n_in; i++)
        in_lp[i] = is_float(c->in[i].dtype) ? tu_convert(&c->in[i], dtype) : tu_clone(&c->in[i]);
    int n_out;
    assert_int_equal(kt_op_arity(c->op, NULL, NULL, &n_out), KT_OK);
    for (int i = 0; i < n_out; i++) {
        gout_lp[i] = gout[i];
        if (gout[i].data != NULL && is_float(gout[i].dtype)) {
            /* The op's float outputs take the low-precision dtype when its inputs do. */
            kt_tensor shapes[KT_OP_MAX_OUT];
            assert_int_equal(kt_op_infer(c->op, &c->attrs, in_lp, c->n_in, shapes, n_out), KT_OK);
            gout_lp[i] = tu_convert(&gout[i], shapes[i].dtype);
        }
    }
    gc_case lp = *c;
    lp.in = in_lp;
    run_result r32, rlp;
    run_op(c, c->in, gout, c->threads, &r32);
    run_op(&lp, in_lp, gout_lp, c->threads, &rlp);
    for (int i = 0; i < n_out; i++) {
        double e = tu_rel_err(&rlp.out[i], &r32.out[i], 1e-6);
        if (e > tol)
            fail_msg("%s %s: output %d differs from f32 by %.3g (bound %.3g)",
                     kt_op_name(c->op), kt_dtype_name(dtype), i, e, tol);
    }
    for (int i = 0; i < c->n_in; i++) {
        if (r32.gin[i].data == NULL)
            continue;
        double e = tu_rel_err(&rlp.gin[i], &r32.gin[i], 1e-6);
        if (e > tol)
            fail_msg("%s %s: gradient of input %d differs from f32 by %.3g (bound %.3g)",
                     kt_op_name(c->op), kt_dtype_name(dtype), i, e, tol);
    }
    for (int i = 0; i < n_out; i++) {
        if (gout_lp[i].data != gout[i].data)
            tu_free(&gout_lp[i]);
        tu_free(&gout[i]);
    }
    for (int i = 0; i < c->n_in; i++)
        tu_free(&in_lp[i]);
    result_free(&r32, c->n_in);
    result_free(&rlp, c->n_in);
}

/* Forward + backward with t1 and then t2 threads: bitwise the same results. */
static void check_same_bits(const gc_case *c_in, int t1, int t2)
{
    gc_case stamped = *c_in; /* the attributes as the test wrote them, made for the op */
    tu_attrs_into(&stamped.attrs, c_in->op, c_in->attrs);
    const gc_case *c = &stamped;
    tu_rng rng;
    tu_rng_seed(&rng, c->seed + 31);
    kt_tensor gout[KT_OP_MAX_OUT];
    make_gout(c, gout, &rng);
    run_result a, b;
    run_op(c, c->in, gout, t1, &a);
    run_op(c, c->in, gout, t2, &b);
    for (int i = 0; i < a.n_out; i++)
        if (!tu_bitwise_equal(&a.out[i], &b.out[i]))
            fail_msg("%s: output %d differs between runs with %d and %d threads",
                     kt_op_name(c->op), i, t1, t2);
    for (int i = 0; i < c->n_in; i++)
        if (a.gin[i].data && !tu_bitwise_equal(&a.gin[i], &b.gin[i]))
            fail_msg("%s: gradient of input %d differs between runs with %d and %d threads",
                     kt_op_name(c->op), i, t1, t2);
    for (int i = 0; i < a.n_out; i++)
        tu_free(&gout[i]);
    result_free(&a, c->n_in);
    result_free(&b, c->n_in);
}

void gc_check_deterministic(const gc_case *c, int threads) { check_same_bits(c, threads, threads); }

void gc_check_thread_invariant(const gc_case *c, int t1, int t2) { check_same_bits(c, t1, t2); }
