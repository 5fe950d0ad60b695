/* attention: forward against a float64 attention written here (every option: grouped and
 * multi-query heads, causal with S = T, S > T and S < T, sliding windows, segment ids, Dv != D,
 * softcap, odd sizes around the kernel's 64-row blocks), backward against float64 finite
 * differences of it, bf16/f16 against f32, determinism and thread-count invariance, rows
 * that see no key, bad input, and the op in a .ktg model trained through a session (the
 * session's gradients equal direct op calls). Under KT_CPU=portable (ctest's
 * test_ops_attention_portable) the same checks run the plain-C block kernels. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/support/gradcheck.h"

/* ---- the float64 reference ------------------------------------------------------------ */

static void ref_attention(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out,
                          int n_out)
{
    (void)n_out;
    const gc_dt *q = &in[0], *k = &in[1], *v = &in[2], *seg = n_in == 4 ? &in[3] : NULL;
    const int64_t B = q->shape[0], T = q->shape[1], Hq = q->shape[2], D = q->shape[3];
    const int64_t S = k->shape[1], Hkv = k->shape[2], Dv = v->shape[3], G = Hq / Hkv;
    const double scale = at->attn_scale > 0 ? at->attn_scale : 1.0 / sqrt((double)D);
    const double cap = at->attn_softcap;
    double *s = malloc((size_t)(S ? S : 1) * sizeof *s);
    char *vis = malloc((size_t)(S ? S : 1));
    assert_non_null(s), assert_non_null(vis);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hq; h++)
            for (int64_t t = 0; t < T; t++) {
                const int64_t p = t + S - T, kh = h / G;
                const double *qr = q->d + ((b * T + t) * Hq + h) * D;
                double m = -INFINITY;
                for (int64_t j = 0; j < S; j++) {
                    vis[j] = (!at->attn_causal || j <= p) &&
                             (at->attn_window == 0 || p - j < at->attn_window) &&
                             (seg == NULL || seg->d[b * S + p] == seg->d[b * S + j]);
                    if (!vis[j])
                        continue;
                    const double *kr = k->d + ((b * S + j) * Hkv + kh) * D;
                    double dot = 0;
                    for (int64_t d = 0; d < D; d++)
                        dot += qr[d] * kr[d];
                    dot *= scale;
                    s[j] = cap > 0 ? cap * tanh(dot / cap) : dot;
                    m = fmax(m, s[j]);
                }
                double sum = 0;
                for (int64_t j = 0; j < S; j++)
                    if (vis[j])
                        sum += exp(s[j] - m);
                double *o = out[0].d + ((b * T + t) * Hq + h) * Dv;
                for (int64_t c = 0; c < Dv; c++)
                    o[c] = 0;
                for (int64_t j = 0; j < S; j++) {
                    if (!vis[j])
                        continue;
                    const double w = exp(s[j] - m) / sum;
                    const double *vr = v->d + ((b * S + j) * Hkv + kh) * Dv;
                    for (int64_t c = 0; c < Dv; c++)
                        o[c] += w * vr[c];
                }
                out[1].d[(b * Hq + h) * T + t] = sum > 0 ? m + log(sum) : 0.0;
            }
    free(s), free(vis);
}

/* ---- cases ------------------------------------------------------------------------------ */

typedef struct shape_case {
    const char *name;
    int64_t B, T, S, Hq, Hkv, D, Dv;
    int causal;
    int64_t window;
    float softcap, scale;
    int segments; /* 0: none, 1: i32, 2: i64 (documents of 1..40 keys) */
} shape_case;

static const shape_case cases[] = {
    {"mha", 2, 37, 37, 4, 4, 16, 16, 0, 0, 0, 0, 0},
    {"gqa 2", 1, 37, 37, 4, 2, 16, 16, 0, 0, 0, 0, 0},
    {"gqa 4 causal", 1, 70, 70, 8, 2, 16, 16, 1, 0, 0, 0, 0},
    {"mqa 8 causal", 1, 37, 37, 8, 1, 8, 8, 1, 0, 0, 0, 0},
    {"gqa 3 heads", 2, 19, 19, 6, 2, 12, 12, 1, 0, 0, 0, 0},
    {"gqa 6 heads (chunks of 4 and 2)", 1, 37, 37, 6, 1, 8, 8, 1, 0, 0, 0, 0},
    {"causal two blocks", 1, 130, 130, 2, 1, 8, 8, 1, 0, 0, 0, 0},
    {"causal S > T", 2, 37, 100, 2, 1, 16, 16, 1, 0, 0, 0, 0},
    {"S > T full", 1, 5, 150, 2, 2, 8, 8, 0, 0, 0, 0, 0},
    {"decode T = 1", 2, 1, 90, 4, 2, 16, 16, 1, 0, 0, 0, 0},
    {"causal S < T (empty rows)", 1, 40, 20, 2, 1, 8, 8, 1, 0, 0, 0, 0},
    {"cross S < T", 1, 50, 9, 2, 1, 8, 8, 0, 0, 0, 0, 0},
    {"window causal", 1, 90, 90, 2, 1, 8, 8, 1, 7, 0, 0, 0},
    {"window 70 causal", 1, 150, 150, 2, 2, 8, 8, 1, 70, 0, 0, 0},
    {"window non-causal", 1, 80, 80, 2, 1, 8, 8, 0, 5, 0, 0, 0},
    {"window S > T", 1, 30, 100, 2, 1, 8, 8, 1, 40, 0, 0, 0},
    {"segments i32 causal", 2, 75, 75, 2, 1, 8, 8, 1, 0, 0, 0, 1},
    {"segments i64", 1, 75, 75, 2, 2, 8, 8, 0, 0, 0, 0, 2},
    {"segments S > T window", 1, 40, 90, 4, 2, 8, 8, 1, 20, 0, 0, 1},
    {"Dv != D", 1, 37, 37, 4, 2, 72, 40, 1, 0, 0, 0, 0},
    {"Dv > D odd", 1, 20, 33, 2, 1, 5, 19, 0, 0, 0, 0, 0},
    {"softcap", 1, 70, 70, 2, 1, 16, 16, 1, 0, 2.5f, 2.0f, 0},
    {"softcap window segments", 1, 66, 66, 2, 1, 8, 8, 1, 9, 4.0f, 0, 2},
    {"scale", 1, 37, 50, 2, 2, 16, 16, 0, 0, 0, 0.7f, 0},
    {"D = Dv = 256 (the bound)", 1, 5, 9, 2, 1, 256, 256, 1, 0, 0, 0, 0},
};
enum { N_CASES = sizeof cases / sizeof cases[0] };

typedef struct built {
    kt_tensor in[4];
    int n_in;
    kt_op_attrs attrs;
} built;

/* q, k, v uniform in [-1, 1] (x2 for larger scores), segments as documents of random
 * lengths; queries take the segment of key S-T+t. */
static built build(const shape_case *c, uint64_t seed)
{
    built r;
    memset(&r, 0, sizeof r);
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    r.in[0] = tu_new(KT_F32, c->B, c->T, c->Hq, c->D);
    r.in[1] = tu_new(KT_F32, c->B, c->S, c->Hkv, c->D);
    r.in[2] = tu_new(KT_F32, c->B, c->S, c->Hkv, c->Dv);
    tu_fill_uniform(&r.in[0], &rng, -2, 2);
    tu_fill_uniform(&r.in[1], &rng, -2, 2);
    tu_fill_uniform(&r.in[2], &rng, -1, 1);
    r.n_in = 3;
    if (c->segments) {
        r.in[3] = tu_new(c->segments == 1 ? KT_I32 : KT_I64, c->B, c->S);
        for (int64_t b = 0; b < c->B; b++) {
            int64_t id = 0, left = 0;
            for (int64_t j = 0; j < c->S; j++) {
                if (left == 0)
                    left = 1 + (int64_t)(tu_rng_next(&rng) % 40), id += 1 + b;
                tu_set(&r.in[3], b * c->S + j, (double)id);
                left--;
            }
        }
        r.n_in = 4;
    }
    r.attrs = TU_ATTRS(KT_OP_ATTENTION, .attn_causal = c->causal, .attn_window = c->window,
                       .attn_softcap = c->softcap, .attn_scale = c->scale);
    return r;
}

static void built_free(built *b)
{
    for (int i = 0; i < b->n_in; i++)
        tu_free(&b->in[i]);
}

static gc_case gcase(const built *b, int threads, uint64_t seed)
{
    gc_case g = {.op = KT_OP_ATTENTION, .attrs = b->attrs, .in = b->in, .n_in = b->n_in,
                 .ref = ref_attention, .probes = 60, .threads = threads, .seed = seed};
    return g;
}

/* ---- forward and backward against float64 -------------------------------------------- */

/* With no pool (or batch x KV heads a multiple of the threads) the backward is the fused one,
 * else it takes the two passes: 0, 2 and 3 threads run both. */
static void test_against_float64(void **state)
{
    (void)state;
    for (int i = 0; i < N_CASES; i++) {
        built b = build(&cases[i], 100 + (uint64_t)i);
        for (int threads = 0; threads <= 3; threads += threads ? 1 : 2) {
            print_message("%s, %d threads\n", cases[i].name, threads);
            gc_case g = gcase(&b, threads, (uint64_t)(10 * i + threads));
            gc_check(&g);
        }
        built_free(&b);
    }
}

/* bf16 keeps 8 significant bits (unit roundoff u = 2^-8... half an ulp: 2^-9), f16 11
 * (2^-12). Rounding q and k moves a score s = scale q.k by about |s| sqrt(2) u; exp turns that
 * into the same relative error of a weight, and o, lse and each gradient are rounded once
 * more. Scores here reach ~8 (q, k in [-2, 2], D = 16, scale 1/4), so a weight moves by ~8 u
 * at worst, and the backward's differences (dp - di) can amplify that a few times relative
 * to the gradient's scale: the bound is 32 u (bf16 6.3e-2, f16 7.8e-3). */
static void test_low_precision(void **state)
{
    (void)state;
    const int pick[] = {1, 2, 7, 12, 15, 18, 20};
    for (size_t n = 0; n < sizeof pick / sizeof pick[0]; n++) {
        const shape_case *c = &cases[pick[n]];
        built b = build(c, 300 + (uint64_t)n);
        gc_case g = gcase(&b, 2, 40 + n);
        gc_check_lowp(&g, KT_BF16, 32.0 * ldexp(1.0, -9));
        gc_check_lowp(&g, KT_F16, 32.0 * ldexp(1.0, -12));
        built_free(&b);
    }
}

/* Each gradient element is summed by one task in a fixed order, so results are the same for
 * any thread count that picks the same backward: the fused one (here: 0, 1, and 2 threads
 * when batch x KV heads is 2) or the two passes (3 and 4 threads when it is 1 or 2). */
static void test_deterministic(void **state)
{
    (void)state;
    const int pick[] = {2, 6, 12, 15, 20};
    for (size_t n = 0; n < sizeof pick / sizeof pick[0]; n++) {
        const shape_case *c = &cases[pick[n]];
        built b = build(c, 500 + (uint64_t)n);
        gc_case g = gcase(&b, 0, 60 + n);
        gc_check_deterministic(&g, 2);
        gc_check_deterministic(&g, 3);
        gc_check_thread_invariant(&g, 0, 1);
        if (c->B * c->Hkv >= 2)
            gc_check_thread_invariant(&g, 1, 2);
        if (c->B * c->Hkv < 3)
            gc_check_thread_invariant(&g, 3, 4);
        kt_tensor lp[4];
        for (int i = 0; i < b.n_in; i++)
            lp[i] = i < 3 ? tu_convert(&b.in[i], KT_BF16) : tu_clone(&b.in[i]);
        g.in = lp;
        gc_check_deterministic(&g, 2);
        gc_check_thread_invariant(&g, 0, 1);
        if (c->B * c->Hkv < 3)
            gc_check_thread_invariant(&g, 3, 4);
        for (int i = 0; i < b.n_in; i++)
            tu_free(&lp[i]);
        built_free(&b);
    }
}

/* Queries before the first key (causal, S < T) see nothing: o = 0, lse = 0, their dq is 0
 * and no NaN anywhere, also with a NaN-free but nonzero output gradient for them. */
static void test_empty_rows(void **state)
{
    (void)state;
    const shape_case c = {"empty", 1, 70, 20, 2, 1, 8, 8, 1, 0, 0, 0, 0};
    built b = build(&c, 9);
    kt_tensor o = tu_new(KT_F32, 1, 70, 2, 8), lse = tu_new(KT_F32, 1, 2, 70);
    kt_tensor out[2] = {o, lse};
    kt_tensor go = tu_new(KT_F32, 1, 70, 2, 8), gl = tu_new(KT_F32, 1, 2, 70);
    tu_rng rng;
    tu_rng_seed(&rng, 3);
    tu_fill_uniform(&go, &rng, -1, 1);
    tu_fill_uniform(&gl, &rng, -1, 1);
    kt_tensor gout[2] = {go, gl};
    kt_tensor gin[3] = {tu_new(KT_F32, 1, 70, 2, 8), tu_new(KT_F32, 1, 20, 1, 8),
                        tu_new(KT_F32, 1, 20, 1, 8)};
    size_t need = kt_op_scratch_bytes(KT_OP_ATTENTION, &b.attrs, b.in, 3, 1);
    void *scratch = NULL;
    assert_int_equal(posix_memalign(&scratch, 64, need), 0);
    kt_exec ex = {.scratch = scratch, .scratch_bytes = need};
    OK(kt_op_forward(KT_OP_ATTENTION, &b.attrs, b.in, 3, out, 2, NULL));
    OK(kt_op_backward(KT_OP_ATTENTION, &b.attrs, b.in, 3, out, 2, gout, gin, &ex));
    for (int64_t t = 0; t < 70; t++)
        for (int64_t h = 0; h < 2; h++) {
            const int empty = t < 50; /* position t - 50 < 0 */
            for (int64_t d = 0; d < 8; d++) {
                const int64_t i = (t * 2 + h) * 8 + d;
                if (empty && (tu_get(&o, i) != 0.0 || tu_get(&gin[0], i) != 0.0))
                    fail_msg("row %lld head %lld sees no key: o %g, dq %g", (long long)t,
                             (long long)h, tu_get(&o, i), tu_get(&gin[0], i));
                if (!empty && tu_get(&o, i) == 0.0)
                    fail_msg("row %lld head %lld: o is 0", (long long)t, (long long)h);
            }
            if (empty && tu_get(&lse, h * 70 + t) != 0.0)
                fail_msg("row %lld: lse %g, want 0", (long long)t, tu_get(&lse, h * 70 + t));
        }
    for (int i = 0; i < 3; i++)
        for (int64_t e = 0; e < kt_tensor_numel(&gin[i]); e++)
            assert_true(isfinite(tu_get(&gin[i], e)));
    free(scratch);
    for (int i = 0; i < 3; i++)
        tu_free(&gin[i]);
    tu_free(&o), tu_free(&lse), tu_free(&go), tu_free(&gl);
    built_free(&b);
}

/* The FLOP count is 2 (D + Dv) per visible pair, per batch and head. */
static void test_flops(void **state)
{
    (void)state;
    kt_tensor q = tu_new(KT_F32, 2, 6, 4, 8), k = tu_new(KT_F32, 2, 10, 2, 8);
    kt_tensor v = tu_new(KT_F32, 2, 10, 2, 4);
    kt_tensor in[3] = {q, k, v};
    const double per = 2.0 * (8 + 4) * 2 * 4;
    kt_op_attrs a = kt_op_defaults(KT_OP_ATTENTION);
    assert_float_equal(kt_op_flops(KT_OP_ATTENTION, &a, in, 3), per * 6 * 10, 1e-9);
    a.attn_causal = 1; /* query t at position t + 4 sees t + 5 keys */
    assert_float_equal(kt_op_flops(KT_OP_ATTENTION, &a, in, 3), per * (5 + 6 + 7 + 8 + 9 + 10),
                       1e-9);
    a.attn_window = 3; /* and at most 3 */
    assert_float_equal(kt_op_flops(KT_OP_ATTENTION, &a, in, 3), per * 6 * 3, 1e-9);
    tu_free(&q), tu_free(&k), tu_free(&v);
}

static void test_bad_input(void **state)
{
    (void)state;
    kt_tensor q = tu_new(KT_F32, 2, 5, 4, 8), k = tu_new(KT_F32, 2, 7, 2, 8);
    kt_tensor v = tu_new(KT_F32, 2, 7, 2, 6), o = tu_new(KT_F32, 2, 5, 4, 6);
    kt_tensor lse = tu_new(KT_F32, 2, 4, 5), outs[2] = {o, lse};
    kt_tensor k3 = tu_new(KT_F32, 2, 7, 3, 8), v3 = tu_new(KT_F32, 2, 7, 3, 6), kd = tu_new(KT_F32, 2, 7, 2, 9);
    kt_tensor kb = tu_new(KT_F32, 1, 7, 2, 8), vs = tu_new(KT_F32, 2, 6, 2, 6);
    kt_tensor vb = tu_new(KT_BF16, 2, 7, 2, 6), q3 = tu_new(KT_F32, 5, 4, 8);
    kt_tensor qi = tu_new(KT_I32, 2, 5, 4, 8), seg = tu_new(KT_I32, 2, 7);
    kt_tensor segf = tu_new(KT_F32, 2, 7), segs = tu_new(KT_I64, 2, 6);
    kt_tensor qbig = tu_new(KT_F32, 1, 1, 1, 300), kbig = tu_new(KT_F32, 1, 1, 1, 300);
    kt_tensor vbig = tu_new(KT_F32, 1, 1, 1, 300);
    kt_tensor in[4] = {q, k, v, seg};
#define EXPECT(n, ...)                                                                        \
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ATTENTION, NULL, in, n, outs, 2, NULL), KT_EINVAL,    \
                    "attention", __VA_ARGS__)
    in[1] = k3, in[2] = v3;
    EXPECT(3, "k", "3 KV heads must divide", "4 query heads");
    in[2] = v;
    in[1] = kd;
    EXPECT(3, "k (head dim", "dimension 3 must be 8");
    in[1] = kb;
    EXPECT(3, "k (batch)", "dimension 0 must be 2");
    in[1] = k, in[2] = vs;
    EXPECT(3, "v (keys", "dimension 1 must be 7");
    in[2] = vb;
    EXPECT(3, "v", "f32 like the first input", "bf16");
    in[2] = v, in[0] = q3;
    EXPECT(3, "q", "4 dimensions");
    in[0] = qi;
    EXPECT(3, "q", "f32, bf16 or f16", "i32");
    in[0] = q, in[3] = segf;
    EXPECT(4, "segments", "i32 or i64", "f32");
    in[3] = segs;
    EXPECT(4, "segments (keys", "dimension 1 must be 7");
    in[3] = seg;
    OK(kt_op_forward(KT_OP_ATTENTION, NULL, in, 4, outs, 2, NULL));
    EXPECT(2, "3 to 4 inputs");
    /* segments need S >= T: a query's segment is that of key S-T+t */
    kt_tensor qlong = tu_new(KT_F32, 2, 9, 4, 8), olong = tu_new(KT_F32, 2, 9, 4, 6);
    kt_tensor llong = tu_new(KT_F32, 2, 4, 9), outl[2] = {olong, llong};
    in[0] = qlong;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ATTENTION, NULL, in, 4, outl, 2, NULL), KT_EINVAL,
                    "attention", "segments", "S (7) must be at least T (9)");
    in[0] = qbig, in[1] = kbig, in[2] = vbig;
    kt_tensor obig = tu_new(KT_F32, 1, 1, 1, 300), lbig = tu_new(KT_F32, 1, 1, 1);
    kt_tensor outb[2] = {obig, lbig};
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ATTENTION, NULL, in, 3, outb, 2, NULL), KT_EINVAL,
                    "attention", "q", "head dim 300", "1..256");
    in[0] = q, in[1] = k, in[2] = v;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ATTENTION,
                                  &TU_ATTRS(KT_OP_ATTENTION, .attn_window = -1), in, 3, outs,
                                  2, NULL),
                    KT_EINVAL, "attention", "window");
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ATTENTION,
                                  &TU_ATTRS(KT_OP_ATTENTION, .attn_softcap = -2.0f), in, 3,
                                  outs, 2, NULL),
                    KT_EINVAL, "attention", "softcap");
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ATTENTION,
                                  &TU_ATTRS(KT_OP_ATTENTION, .attn_scale = NAN), in, 3, outs, 2,
                                  NULL),
                    KT_EINVAL, "attention", "scale");
    /* the backward's di lives in scratch */
    kt_tensor gin[3] = {tu_new(KT_F32, 2, 5, 4, 8), tu_new(KT_F32, 2, 7, 2, 8),
                        tu_new(KT_F32, 2, 7, 2, 6)};
    OK(kt_op_forward(KT_OP_ATTENTION, NULL, in, 3, outs, 2, NULL));
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_ATTENTION, NULL, in, 3, outs, 2, outs, gin, NULL),
                    KT_EINVAL, "attention", "scratch");
#undef EXPECT
    kt_tensor all[] = {q, k, v, o, lse, k3, v3, kd, kb, vs, vb, q3, qi, seg, segf, segs, qbig,
                       kbig, vbig, qlong, olong, llong, obig, lbig, gin[0], gin[1], gin[2]};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tu_free(&all[i]);
}

/* ---- a .ktg model through a session -------------------------------------------------------- */

/* q, k, v are parameters; loss = cross_entropy(o as [T*Hq, Dv] logits, targets). */
static const char model_src[] =
    "const T = 24\n"
    "const HQ = 4\n"
    "const HKV = 2\n"
    "const D = 8\n"
    "const DV = 6\n"
    "input y: i32[T * HQ]\n"
    "input seg: i64[1, T]\n"
    "param q: f32[1, T, HQ, D] = normal(1.0)\n"
    "param k: f32[1, T, HKV, D] = normal(1.0)\n"
    "param v: f32[1, T, HKV, DV] = normal(1.0)\n"
    "o, lse = attention(q, k, v, seg, causal = 1, window = 10, softcap = 5.0)\n"
    "logits = reshape(o, shape = [T * HQ, DV])\n"
    "loss = cross_entropy(logits, y)\n"
    "output logits\n"
    "output lse\n"
    "loss loss\n";

enum { MT = 24, MHQ = 4, MHKV = 2, MD = 8, MDV = 6 };

static kt_tensor session_get(kt_session *s, kt_tensor_role role, const char *name)
{
    kt_tensor t;
    OK(kt_session_tensor(s, role, name, &t));
    return t;
}

static void test_graph_session(void **state)
{
    (void)state;
    kt_graph *g = NULL;
    char diag[4096];
    int n_err = 0;
    if (kt_ktg_parse(model_src, strlen(model_src), "attn.ktg", NULL, 0, &g, diag, sizeof diag,
                     &n_err) != KT_OK)
        fail_msg("the model does not parse:\n%s", diag);
    kt_program *p = NULL;
    OK(kt_compile(g, NULL, &p));
    kt_optimizer_config sgd = {.kind = KT_OPTIM_SGD, .lr = 2.0f, .momentum = 0.9f};
    kt_session_options so = {.threads = 2, .seed = 3, .optimizer = sgd};
    kt_session *s = NULL;
    OK(kt_session_create(p, &so, &s));

    kt_tensor y = session_get(s, KT_ROLE_INPUT, "y"), seg = session_get(s, KT_ROLE_INPUT, "seg");
    for (int64_t i = 0; i < MT * MHQ; i++)
        tu_set(&y, i, (double)((i * 7) % MDV));
    for (int64_t i = 0; i < MT; i++)
        tu_set(&seg, i, (double)(i < 15 ? 0 : 1));
    OK(kt_session_forward(s));
    const float loss0 = kt_session_loss(s);
    OK(kt_session_backward(s));

    /* the same through direct calls */
    const char *names[3] = {"q", "k", "v"};
    kt_tensor in[4], gin[4];
    for (int i = 0; i < 3; i++) {
        const kt_tensor t = session_get(s, KT_ROLE_PARAM, names[i]);
        in[i] = tu_clone(&t);
    }
    in[3] = tu_clone(&seg);
    const kt_op_attrs at = TU_ATTRS(KT_OP_ATTENTION, .attn_causal = 1, .attn_window = 10,
                                    .attn_softcap = 5.0f);
    kt_tensor o = tu_new(KT_F32, 1, MT, MHQ, MDV), lse = tu_new(KT_F32, 1, MHQ, MT);
    kt_tensor outs[2] = {o, lse};
    OK(kt_op_forward(KT_OP_ATTENTION, &at, in, 4, outs, 2, NULL));
    kt_tensor logits;
    OK(kt_tensor_init(&logits, o.data, KT_F32, 2, (const int64_t[]){MT * MHQ, MDV}));
    const kt_op_attrs ce = kt_op_defaults(KT_OP_CROSS_ENTROPY);
    kt_tensor ce_in[2] = {logits, tu_clone(&y)}, loss = tu_alloc(KT_F32, 0, NULL);
    OK(kt_op_forward(KT_OP_CROSS_ENTROPY, &ce, ce_in, 2, &loss, 1, NULL));
    assert_float_equal(loss0, tu_get(&loss, 0), 1e-6 * fabs(tu_get(&loss, 0)));
    kt_tensor seed = tu_alloc(KT_F32, 0, NULL), glog = tu_new(KT_F32, MT * MHQ, MDV);
    tu_set(&seed, 0, 1.0);
    kt_tensor ce_gin[2] = {glog, ce_in[1]};
    ce_gin[1].data = NULL;
    OK(kt_op_backward(KT_OP_CROSS_ENTROPY, &ce, ce_in, 2, &loss, 1, &seed, ce_gin, NULL));
    kt_tensor go, gl = tu_new(KT_F32, 1, MHQ, MT);
    OK(kt_tensor_init(&go, glog.data, KT_F32, 4, (const int64_t[]){1, MT, MHQ, MDV}));
    memset(gl.data, 0, kt_tensor_nbytes(&gl)); /* nothing uses lse */
    kt_tensor gouts[2] = {go, gl};
    for (int i = 0; i < 3; i++)
        gin[i] = tu_alloc(KT_F32, in[i].ndim, in[i].shape);
    gin[3] = in[3];
    gin[3].data = NULL;
    size_t need = kt_op_scratch_bytes(KT_OP_ATTENTION, &at, in, 4, 1);
    kt_exec ex = {.scratch = malloc(need), .scratch_bytes = need};
    OK(kt_op_backward(KT_OP_ATTENTION, &at, in, 4, outs, 2, gouts, gin, &ex));
    free(ex.scratch);
    for (int i = 0; i < 3; i++) {
        kt_tensor sg = session_get(s, KT_ROLE_GRAD, names[i]);
        const double e = tu_rel_err(&sg, &gin[i], 1e-12);
        if (!(e <= 1e-6))
            fail_msg("gradient of %s: session and direct call differ by %.3g", names[i], e);
    }
    kt_tensor lse_s = session_get(s, KT_ROLE_OUTPUT, "lse");
    assert_true(tu_rel_err(&lse_s, &lse, 1e-12) <= 1e-6);

    /* training lowers the loss (SGD lr 2, momentum 0.9, 40 steps; measured 2.017 -> 0.783) */
    OK(kt_session_step(s));
    for (int step = 1; step < 40; step++) {
        OK(kt_session_forward(s));
        OK(kt_session_backward(s));
        OK(kt_session_step(s));
    }
    OK(kt_session_forward(s));
    const float loss1 = kt_session_loss(s);
    print_message("attention model: loss %.4f -> %.4f\n", loss0, loss1);
    assert_true(loss1 < 0.5f * loss0);

    for (int i = 0; i < 4; i++)
        tu_free(&in[i]);
    for (int i = 0; i < 3; i++)
        tu_free(&gin[i]);
    tu_free(&o), tu_free(&lse), tu_free(&ce_in[1]), tu_free(&loss), tu_free(&seed);
    tu_free(&glog), tu_free(&gl);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

/* ---- cp_attention on one rank ---------------------------------------------------------- */

/* With no communicator cp_attention is causal attention on its shard, run chunk by chunk (two
 * halves, each on its key prefix) with the prefix gradients summed: the float64 reference is
 * ref_attention made causal. bf16 and f16 against f32 within test_low_precision's bounds. */
static void ref_cp_attention(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out,
                             int n_out)
{
    kt_op_attrs a = *at;
    a.attn_causal = 1;
    ref_attention(&a, in, n_in, out, n_out);
}

static void test_cp_one_rank(void **state)
{
    (void)state;
    /* B, T (= S), Hq, Hkv, D, Dv, causal (ignored), window, softcap, scale, segments */
    static const shape_case cp_cases[] = {
        {"cp mha", 2, 10, 10, 2, 2, 8, 8, 1, 0, 0, 0, 0},
        {"cp gqa 2 blocks a chunk", 1, 140, 140, 4, 2, 8, 6, 1, 0, 0, 0, 0},
        {"cp window", 1, 90, 90, 2, 1, 8, 8, 1, 30, 0, 0, 0},
        {"cp segments i64 softcap", 2, 76, 76, 2, 1, 8, 8, 1, 0, 3.0f, 0, 2},
        {"cp segments window scale", 1, 66, 66, 4, 2, 8, 8, 1, 9, 0, 0.5f, 1},
    };
    for (size_t i = 0; i < sizeof cp_cases / sizeof cp_cases[0]; i++)
        for (int layout = 0; layout <= 1; layout++) {
            built b = build(&cp_cases[i], 700 + i);
            b.attrs = TU_ATTRS(KT_OP_CP_ATTENTION, .attn_window = cp_cases[i].window,
                               .attn_softcap = cp_cases[i].softcap,
                               .attn_scale = cp_cases[i].scale, .cp_layout = layout);
            /* no pool: the fused backward; 3 threads: the two passes (B x Hkv < 3 * 4) */
            for (int threads = 0; threads <= 3; threads += 3) {
                print_message("%s, layout %d, %d threads\n", cp_cases[i].name, layout, threads);
                gc_case g = gcase(&b, threads, 80 + i);
                g.op = KT_OP_CP_ATTENTION;
                g.ref = ref_cp_attention;
                gc_check(&g);
                if (threads == 3) {
                    gc_check_lowp(&g, KT_BF16, 32.0 * ldexp(1.0, -9));
                    gc_check_lowp(&g, KT_F16, 32.0 * ldexp(1.0, -12));
                    gc_check_deterministic(&g, 3);
                }
            }
            built_free(&b);
        }
}

static void test_cp_bad_input(void **state)
{
    (void)state;
    kt_tensor q = tu_new(KT_F32, 2, 6, 4, 8), k = tu_new(KT_F32, 2, 6, 2, 8);
    kt_tensor v = tu_new(KT_F32, 2, 6, 2, 4), o = tu_new(KT_F32, 2, 6, 4, 4);
    kt_tensor lse = tu_new(KT_F32, 2, 4, 6), outs[2] = {o, lse};
    kt_tensor kt7 = tu_new(KT_F32, 2, 7, 2, 8), q5 = tu_new(KT_F32, 2, 5, 4, 8);
    kt_tensor k5 = tu_new(KT_F32, 2, 5, 2, 8), v5 = tu_new(KT_F32, 2, 5, 2, 4);
    kt_tensor k3 = tu_new(KT_F32, 2, 6, 3, 8), v3 = tu_new(KT_F32, 2, 6, 3, 4);
    kt_tensor seg5 = tu_new(KT_I32, 2, 5);
    kt_tensor in[4] = {q, kt7, v, seg5};
    const kt_op_attrs at = kt_op_defaults(KT_OP_CP_ATTENTION);
#define EXPECT(n, ...)                                                                        \
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CP_ATTENTION, &at, in, n, outs, 2, NULL), KT_EINVAL,  \
                    "cp_attention", __VA_ARGS__)
    EXPECT(3, "k (time, as q's", "dimension 1 must be 6");
    in[0] = q5, in[1] = k5, in[2] = v5;
    EXPECT(3, "q", "5 positions must be even");
    in[0] = q, in[1] = k3, in[2] = v3;
    EXPECT(3, "k", "3 KV heads must divide");
    in[1] = k, in[2] = v;
    EXPECT(4, "segments (time", "dimension 1 must be 6");
    /* scratch holds the gathered keys: a direct call without it fails, naming it */
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CP_ATTENTION, &at, in, 3, outs, 2, NULL), KT_EINVAL,
                    "cp_attention", "scratch");
#undef EXPECT
    kt_tensor all[] = {q, k, v, o, lse, kt7, q5, k5, v5, k3, v3, seg5};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tu_free(&all[i]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_against_float64), cmocka_unit_test(test_low_precision),
        cmocka_unit_test(test_deterministic),   cmocka_unit_test(test_empty_rows),
        cmocka_unit_test(test_flops),           cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_graph_session),   cmocka_unit_test(test_cp_one_rank),
        cmocka_unit_test(test_cp_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
