/* rope: forward against a float64 reference written here (rotate_half, interleaved and
 * deinterleaved layouts; partial rotary; positions absent, [T] and [B,T]; [T,H,D] and
 * [B,T,H,D]; linear and YaRN scaling), values worked by hand, each pair's norm kept (times the
 * attention factor), backward against finite differences, bf16/f16 against f32, determinism,
 * in place, bad input with its messages, and the session path: the table bind builds is the
 * direct path's values bit for bit, the kernels read it, bad positions fail the step, and a
 * recomputed rope under checkpointing gives the same gradient bits. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "graph/program_internal.h"
#include "graph/runtime/session_internal.h"
#include "lib/ops/rope.h"
#include "tests/support/gradcheck.h"

#define PI 3.14159265358979323846

/* ---- the float64 reference ------------------------------------------------------------------ */

/* transformers' get_mscale */
static double ref_mscale(double scale, double m)
{
    return scale <= 1.0 ? 1.0 : 0.1 * m * log(scale) + 1.0;
}

/* The angle of pair j at position p and the factor on cos and sin, as transformers'
 * default, linear and yarn rope parameters define them (written out again here). */
static double ref_angle(const kt_op_attrs *at, int r, int j, double p, double *attn)
{
    const double theta = at->rope_theta, factor = at->rope_factor;
    const double freq = 1.0 / pow(theta, (double)(2 * j) / r);
    *attn = 1.0;
    double angle = p * freq;
    if (at->rope_scaling == KT_ROPE_SCALING_LINEAR) {
        angle = (p / factor) * freq;
    } else if (at->rope_scaling == KT_ROPE_SCALING_YARN) {
        const double orig = (double)at->rope_original_max_positions;
        double lo = r * log(orig / (at->rope_beta_fast * 2 * PI)) / (2 * log(theta));
        double hi = r * log(orig / (at->rope_beta_slow * 2 * PI)) / (2 * log(theta));
        if (at->rope_truncate)
            lo = floor(lo), hi = ceil(hi);
        lo = lo < 0 ? 0 : lo;
        hi = hi > r - 1 ? r - 1 : hi;
        if (hi == lo)
            hi += 0.001;
        double ramp = (j - lo) / (hi - lo);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        const double extrapolation = 1 - ramp;
        angle = p * (freq / factor * ramp + freq * extrapolation);
        if (at->rope_mscale != 0 && at->rope_mscale_all_dim != 0)
            *attn = ref_mscale(factor, at->rope_mscale) /
                    ref_mscale(factor, at->rope_mscale_all_dim);
        else
            *attn = ref_mscale(factor, 1.0);
    }
    if (at->rope_attention_factor != 0)
        *attn = at->rope_attention_factor;
    return angle;
}

static void ref_rope(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)n_out;
    const gc_dt *x = &in[0];
    const int nd = x->ndim;
    const int64_t d = x->shape[nd - 1], heads = x->shape[nd - 2], t_len = x->shape[nd - 3];
    const int r = at->rope_rotary_dim ? at->rope_rotary_dim : (int)d, h = r / 2;
    memcpy(out[0].d, x->d, (size_t)x->n * sizeof(double)); /* what passes through */
    for (int64_t tok = 0; tok < x->n / (heads * d); tok++) {
        double p = (double)(tok % t_len);
        if (n_in > 1)
            p = in[1].d[in[1].ndim == 2 ? tok : tok % t_len];
        for (int64_t hd = 0; hd < heads; hd++) {
            const double *xr = x->d + (tok * heads + hd) * d;
            double *yr = out[0].d + (tok * heads + hd) * d;
            for (int j = 0; j < h; j++) {
                double attn;
                const double a = ref_angle(at, r, j, p, &attn);
                const int ia = at->rope_interleaved ? 2 * j : j;
                const int ib = at->rope_interleaved ? 2 * j + 1 : j + h;
                const int oa = at->rope_interleaved && !at->rope_deinterleave ? ia : j;
                const int ob = at->rope_interleaved && !at->rope_deinterleave ? ib : j + h;
                yr[oa] = attn * (xr[ia] * cos(a) - xr[ib] * sin(a));
                yr[ob] = attn * (xr[ib] * cos(a) + xr[ia] * sin(a));
            }
        }
    }
}

/* ---- helpers ------------------------------------------------------------------------------- */

enum { HALF = 0, INTERLEAVED = 1, DEINTERLEAVE = 2 };
static const char *const style_names[3] = {"half", "interleaved", "deinterleave"};

static kt_op_attrs rope_attrs(int style, int rotary_dim, int64_t max_positions)
{
    kt_op_attrs a = kt_op_defaults(KT_OP_ROPE);
    a.rope_interleaved = style != HALF;
    a.rope_deinterleave = style == DEINTERLEAVE;
    a.rope_rotary_dim = rotary_dim;
    a.rope_max_positions = max_positions;
    return a;
}

static kt_op_attrs yarn_attrs(int style, int rotary_dim, int64_t max_positions)
{
    kt_op_attrs a = rope_attrs(style, rotary_dim, max_positions);
    a.rope_scaling = KT_ROPE_SCALING_YARN;
    a.rope_factor = 40.0f;
    a.rope_original_max_positions = 4096;
    return a;
}

/* positions in [0, max) for a [B,T] or [T] tensor */
static kt_tensor make_positions(kt_dtype dt, int per_batch, int64_t b, int64_t t, int64_t max,
                                tu_rng *rng)
{
    kt_tensor p = per_batch ? tu_new(dt, b, t) : tu_new(dt, t);
    tu_fill_uniform(&p, rng, 0, (double)max);
    return p;
}

static void check(const kt_op_attrs *at, const kt_tensor *in, int n_in, int threads,
                  uint64_t seed, double fwd_tol)
{
    gc_case c = {.op = KT_OP_ROPE, .attrs = *at, .in = in, .n_in = n_in, .ref = ref_rope,
                 .threads = threads, .probes = 300, .seed = seed, .fwd_tol = fwd_tol};
    gc_check(&c);
}

/* ---- forward and backward against float64 ---------------------------------------------------- */

/* Every layout, full and partial rotary, [T,H,D] and [B,T,H,D], positions absent, [T] (i32)
 * and [B,T] (i64), with no pool and with 2 threads. */
static void test_layouts(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 1);
    const int64_t b = 2, t = 5, heads = 3, d = 12;
    for (int style = 0; style < 3; style++)
        for (int rot = 0; rot <= 8; rot += 8) /* 0: all 12; 8: 4 pass through */
            for (int nd = 3; nd <= 4; nd++)
                for (int pmode = 0; pmode < (nd == 4 ? 3 : 2); pmode++) {
                    kt_tensor in[2];
                    in[0] = nd == 4 ? tu_new(KT_F32, b, t, heads, d) : tu_new(KT_F32, t, heads, d);
                    tu_fill_uniform(&in[0], &rng, -2, 2);
                    if (pmode > 0)
                        in[1] = make_positions(pmode == 1 ? KT_I32 : KT_I64, pmode == 2, b, t,
                                               300, &rng);
                    const kt_op_attrs at = rope_attrs(style, rot, 300);
                    for (int threads = 0; threads <= 2; threads += 2)
                        check(&at, in, pmode > 0 ? 2 : 1, threads,
                              (uint64_t)(100 * style + 10 * rot + nd + threads), 0);
                    tu_free(&in[0]);
                    if (pmode > 0)
                        tu_free(&in[1]);
                }
}

/* theta, linear scaling, YaRN with and without DeepSeek's mscale split, an explicit attention
 * factor and no truncation, at positions up to 60000 (past the trained 4096). */
static void test_scaling(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 2);
    kt_tensor in[2] = {tu_new(KT_F32, 2, 6, 2, 16)};
    tu_fill_uniform(&in[0], &rng, -1, 1);
    in[1] = make_positions(KT_I64, 1, 2, 6, 65536, &rng);
    tu_set(&in[1], 0, 65535); /* the last position */
    for (int style = 0; style < 3; style++) {
        kt_op_attrs v[7];
        v[0] = rope_attrs(style, 0, 65536);
        v[0].rope_theta = 1e6f;
        v[1] = v[0];
        v[1].rope_scaling = KT_ROPE_SCALING_LINEAR;
        v[1].rope_factor = 8.0f;
        v[2] = yarn_attrs(style, 0, 65536); /* m(1): attention factor 0.1 ln 40 + 1 */
        v[3] = v[2];
        v[3].rope_mscale = 0.707f, v[3].rope_mscale_all_dim = 0.707f; /* DeepSeek-V2: 1 */
        v[4] = v[2];
        v[4].rope_mscale = 1.0f, v[4].rope_mscale_all_dim = 0.5f;
        v[5] = v[2];
        v[5].rope_attention_factor = 0.75f, v[5].rope_truncate = 0;
        v[6] = v[2];
        v[6].rope_beta_fast = 8.0f, v[6].rope_beta_slow = 2.0f, v[6].rope_rotary_dim = 10;
        for (int i = 0; i < 7; i++)
            check(&v[i], in, 2, 2, (uint64_t)(10 * style + i), 0);
    }
    tu_free(&in[0]), tu_free(&in[1]);
}

/* Values worked out by hand: pair 0 turns by the position itself (inv_freq_0 = 1), so x =
 * (1, 0) at position 1 becomes (cos 1, sin 1), in each layout's places; DeepSeek-V2-Lite's YaRN
 * (r = 64, factor 40 over 4096, beta 32/1) keeps pairs 0..10, divides pairs 23.. by 40, and its
 * mscale split makes the attention factor 1. */
static void test_known_values(void **state)
{
    (void)state;
    kt_tensor x = tu_new(KT_F32, 2, 1, 4), y = tu_new(KT_F32, 2, 1, 4);
    /* token 0, at position 0: unchanged (deinterleave: moved to [evens | odds]) */
    const double x0[4] = {0.5, -1.0, 0.25, 3.0};
    for (int i = 0; i < 4; i++)
        tu_set(&x, i, x0[i]);
    tu_set(&x, 4, 1.0); /* token 1, at position 1: (1, 0, 2, 0) */
    tu_set(&x, 6, 2.0);
    /* pair 1 of r = 4 turns by 10000^(-2/4) = 0.01 a position */
    const double c1 = cos(1.0), s1 = sin(1.0), c2 = cos(0.01), s2 = sin(0.01);
    const double want[3][4] = {
        {c1 - 2 * s1, 0, 2 * c1 + s1, 0}, /* half: pair 0 = (x0, x2) = (1, 2), pair 1 = 0 */
        {c1, s1, 2 * c2, 2 * s2},         /* interleaved: (1, 0) at 1, (2, 0) at 0.01 */
        {c1, 2 * c2, s1, 2 * s2},         /* deinterleave: the same as [evens | odds] */
    };
    for (int style = 0; style < 3; style++) {
        const kt_op_attrs at = rope_attrs(style, 0, 16);
        OK(kt_op_forward(KT_OP_ROPE, &at, &x, 1, &y, 1, NULL));
        for (int i = 0; i < 4; i++) {
            const double same = style == DEINTERLEAVE ? x0[(i % 2) * 2 + i / 2] : x0[i];
            if (tu_get(&y, i) != same)
                fail_msg("%s: y[0][%d] = %.9g, want %.9g", style_names[style], i,
                         tu_get(&y, i), same);
            if (fabs(tu_get(&y, 4 + i) - want[style][i]) > 1e-6)
                fail_msg("%s: y[1][%d] = %.9g, want %.9g", style_names[style], i,
                         tu_get(&y, 4 + i), want[style][i]);
        }
    }
    kt_op_attrs v2 = yarn_attrs(INTERLEAVED, 0, 8);
    v2.rope_mscale = 0.707f, v2.rope_mscale_all_dim = 0.707f;
    kt__rope_freqs f;
    const kt__rope_key k = kt__rope_key_of(&v2, 64);
    kt__rope_freqs_of(&k, &f);
    assert_int_equal(f.half, 32);
    assert_true(f.attn == 1.0);
    for (int j = 0; j < 32; j++) {
        const double base = pow(10000.0, -j / 32.0);
        if (j <= 10 && fabs(f.inv_freq[j] / base - 1) > 1e-12)
            fail_msg("pair %d: inv_freq %.17g, want %.17g (extrapolated)", j, f.inv_freq[j], base);
        if (j >= 23 && fabs(f.inv_freq[j] * 40 / base - 1) > 1e-12)
            fail_msg("pair %d: inv_freq %.17g, want %.17g / 40", j, f.inv_freq[j], base);
        if (j > 10 && j < 23 && !(f.inv_freq[j] < base && f.inv_freq[j] > base / 40))
            fail_msg("pair %d: inv_freq %.17g is not between the two", j, f.inv_freq[j]);
    }
    kt_op_attrs m1 = yarn_attrs(HALF, 0, 8);
    const kt__rope_key k1 = kt__rope_key_of(&m1, 64);
    kt__rope_freqs_of(&k1, &f);
    assert_true(fabs(f.attn - (0.1 * log(40.0) + 1)) < 1e-15);
    tu_free(&x), tu_free(&y);
}

/* Each pair keeps its norm (times the attention factor): the turn is a rotation. */
static void test_pair_norms(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 3);
    const int64_t t = 7, heads = 2, d = 20;
    kt_tensor in[2] = {tu_new(KT_F32, t, heads, d), tu_new(KT_I32, t)};
    kt_tensor y = tu_new(KT_F32, t, heads, d);
    tu_fill_uniform(&in[0], &rng, -3, 3);
    tu_fill_uniform(&in[1], &rng, 0, 100000);
    for (int style = 0; style < 3; style++)
        for (int yarn = 0; yarn < 2; yarn++) {
            kt_op_attrs at = yarn ? yarn_attrs(style, 16, 100000) : rope_attrs(style, 16, 100000);
            const double attn = yarn ? 0.1 * log(40.0) + 1 : 1.0;
            OK(kt_op_forward(KT_OP_ROPE, &at, in, 2, &y, 1, NULL));
            for (int64_t row = 0; row < t * heads; row++)
                for (int j = 0; j < 8; j++) {
                    const int64_t o = row * d;
                    const int ia = style == HALF ? j : 2 * j, ib = style == HALF ? j + 8 : 2 * j + 1;
                    const int oa = style == DEINTERLEAVE ? j : ia;
                    const int ob = style == DEINTERLEAVE ? j + 8 : ib;
                    const double nx = hypot(tu_get(&in[0], o + ia), tu_get(&in[0], o + ib));
                    const double ny = hypot(tu_get(&y, o + oa), tu_get(&y, o + ob));
                    if (fabs(ny - attn * nx) > 1e-6 * (1 + nx))
                        fail_msg("%s yarn=%d row %lld pair %d: |y| = %.9g, want %.9g",
                                 style_names[style], yarn, (long long)row, j, ny, attn * nx);
                }
            for (int64_t row = 0; row < t * heads; row++) /* elements 16..19 pass through */
                for (int64_t e = 16; e < d; e++)
                    assert_true(tu_get(&y, row * d + e) == tu_get(&in[0], row * d + e));
        }
    tu_free(&in[0]), tu_free(&in[1]), tu_free(&y);
}

/* ---- precision, determinism, in place ------------------------------------------------------ */

/* bf16 keeps 8 significant bits: rounding x (up to 2^-9 of it) and then y once more bounds the
 * error relative to the scale near 2^-8 ~ 4e-3; f16 near 2^-11 ~ 5e-4. Measured worst cases
 * over 20 seeds of these shapes, outputs and gradients: bf16 6.1e-3, f16 7.3e-4; the bounds
 * leave 2x. */
static void test_low_precision(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 4);
    kt_tensor in[2] = {tu_new(KT_F32, 2, 33, 4, 24)};
    tu_fill_uniform(&in[0], &rng, -3, 3);
    in[1] = make_positions(KT_I32, 1, 2, 33, 8192, &rng);
    for (int style = 0; style < 3; style++) {
        const kt_op_attrs at = style == 1 ? yarn_attrs(style, 16, 8192) : rope_attrs(style, 0, 8192);
        gc_case c = {.op = KT_OP_ROPE, .attrs = at, .in = in, .n_in = 2, .threads = 2,
                     .seed = (uint64_t)(5 + style)};
        gc_check_lowp(&c, KT_BF16, 1.2e-2);
        gc_check_lowp(&c, KT_F16, 1.5e-3);
    }
    tu_free(&in[0]), tu_free(&in[1]);
}

static void test_deterministic(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 8);
    /* enough rows to be split over 3 threads */
    kt_tensor in[2] = {tu_new(KT_F32, 4, 64, 8, 32)};
    tu_fill_uniform(&in[0], &rng, -2, 2);
    in[1] = make_positions(KT_I64, 1, 4, 64, 4096, &rng);
    for (int style = 0; style < 3; style++) {
        gc_case c = {.op = KT_OP_ROPE, .attrs = yarn_attrs(style, 24, 4096), .in = in,
                     .n_in = 2, .seed = (uint64_t)(9 + style)};
        gc_check_deterministic(&c, 2);
        gc_check_deterministic(&c, 3);
        gc_check_thread_invariant(&c, 0, 3); /* rows are independent: any partition */
    }
    tu_free(&in[0]), tu_free(&in[1]);
}

/* Forward into x's own memory and backward into the output gradient's give the bytes of
 * separate buffers, in every layout (deinterleave permutes the rotated part). */
static void test_inplace(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 12);
    kt_tensor x32 = tu_new(KT_F32, 3, 4, 2, 40), pos = tu_new(KT_I32, 4);
    tu_fill_uniform(&x32, &rng, -2, 2);
    tu_fill_uniform(&pos, &rng, 0, 64);
    for (int dt = 0; dt < 2; dt++)
        for (int style = 0; style < 3; style++) {
            const kt_op_attrs at = rope_attrs(style, 32, 64);
            kt_tensor x = dt ? tu_convert(&x32, KT_BF16) : tu_clone(&x32);
            kt_tensor sep = tu_clone(&x), gsep = tu_clone(&x);
            kt_tensor in[2] = {x, pos};
            OK(kt_op_forward(KT_OP_ROPE, &at, in, 2, &sep, 1, NULL));
            kt_tensor gin[2] = {gsep, {0}};
            OK(kt_op_backward(KT_OP_ROPE, &at, in, 2, &sep, 1, &x, gin, NULL));
            kt_tensor own[2] = {tu_clone(&x), pos};
            OK(kt_op_forward(KT_OP_ROPE, &at, own, 2, &own[0], 1, NULL));
            if (!tu_bitwise_equal(&own[0], &sep))
                fail_msg("%s %s: in-place forward differs", style_names[style],
                         kt_dtype_name(x.dtype));
            kt_tensor g = tu_clone(&x), gin2[2] = {g, {0}};
            OK(kt_op_backward(KT_OP_ROPE, &at, in, 2, &sep, 1, &g, gin2, NULL));
            if (!tu_bitwise_equal(&g, &gsep))
                fail_msg("%s %s: in-place backward differs", style_names[style],
                         kt_dtype_name(x.dtype));
            tu_free(&x), tu_free(&sep), tu_free(&gsep), tu_free(&own[0]), tu_free(&g);
        }
    tu_free(&x32), tu_free(&pos);
}

/* ---- bad input ----------------------------------------------------------------------------- */

static void test_bad_input(void **state)
{
    (void)state;
    kt_tensor x = tu_new(KT_F32, 2, 3, 2, 8), y = tu_new(KT_F32, 2, 3, 2, 8);
    kt_tensor pos_t = tu_new(KT_I32, 3), pos_bt = tu_new(KT_I64, 2, 3);
    kt_op_attrs at = rope_attrs(HALF, 0, 16);
    kt_tensor in[2] = {x, pos_t};
    /* positions out of range, [T] and [B,T], forward and backward */
    tu_set(&pos_t, 2, 16);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &at, in, 2, &y, 1, NULL), KT_EINVAL, "rope",
                    "positions", "entry 2 = 16", "0..15", "max_positions = 16");
    kt_tensor gin[2] = {tu_new(KT_F32, 2, 3, 2, 8), {0}};
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_ROPE, &at, in, 2, &y, 1, &y, gin, NULL), KT_EINVAL,
                    "rope", "positions", "entry 2 = 16");
    tu_set(&pos_t, 2, 0);
    tu_set(&pos_bt, 4, -1);
    in[1] = pos_bt;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &at, in, 2, &y, 1, NULL), KT_EINVAL, "rope",
                    "positions", "entry 4 (batch 1, t 1) = -1");
    tu_set(&pos_bt, 4, 3);
    /* no positions: T must fit */
    kt_op_attrs small = rope_attrs(HALF, 0, 2);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &small, &x, 1, &y, 1, NULL), KT_EINVAL, "rope",
                    "T = 3", "max_positions = 2");
    /* positions of the wrong shape and dtype */
    kt_tensor p4 = tu_new(KT_I32, 4), p32 = tu_new(KT_I32, 3, 2), pf = tu_new(KT_F32, 3);
    in[1] = p4;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &at, in, 2, &y, 1, NULL), KT_EINVAL, "rope",
                    "positions must be [T] = [3] or [B,T] = [2,3]", "i32[4]");
    in[1] = p32;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &at, in, 2, &y, 1, NULL), KT_EINVAL, "rope",
                    "positions must be", "i32[3,2]");
    in[1] = pf;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &at, in, 2, &y, 1, NULL), KT_EINVAL, "rope",
                    "positions", "i32 or i64", "f32");
    kt_tensor x3 = tu_new(KT_F32, 3, 2, 8), y3 = tu_new(KT_F32, 3, 2, 8);
    kt_tensor in3[2] = {x3, pos_bt}; /* [B,T] positions with a [T,H,D] x */
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &at, in3, 2, &y3, 1, NULL), KT_EINVAL, "rope",
                    "positions must be [T] = [3]", "i64[2,3]");
    /* x: dtype and rank */
    kt_tensor xi = tu_new(KT_I32, 3, 2, 8), x2 = tu_new(KT_F32, 6, 8);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &at, &xi, 1, &y3, 1, NULL), KT_EINVAL, "rope",
                    "x", "f32, bf16 or f16", "i32");
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &at, &x2, 1, &x2, 1, NULL), KT_EINVAL, "rope",
                    "x", "3 to 4 dimensions");
    /* rotary_dim: odd, past D, D odd with rotary_dim 0, past the kernel's limit, negative */
    kt_op_attrs odd = rope_attrs(HALF, 5, 16), big = rope_attrs(HALF, 10, 16);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &odd, &x3, 1, &y3, 1, NULL), KT_EINVAL, "rope",
                    "rotary_dim = 5", "even");
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &big, &x3, 1, &y3, 1, NULL), KT_EINVAL, "rope",
                    "rotary_dim = 10", "head dim D = 8");
    kt_tensor x7 = tu_new(KT_F32, 3, 2, 7), y7 = tu_new(KT_F32, 3, 2, 7);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &at, &x7, 1, &y7, 1, NULL), KT_EINVAL, "rope",
                    "D = 7 is odd", "rotary_dim");
    kt_op_attrs six = rope_attrs(HALF, 6, 16);
    OK(kt_op_forward(KT_OP_ROPE, &six, &x7, 1, &y7, 1, NULL)); /* 6 of 7 rotate: fine */
    kt_tensor xw = tu_new(KT_F32, 1, 1, 1026), yw = tu_new(KT_F32, 1, 1, 1026);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &at, &xw, 1, &yw, 1, NULL), KT_EINVAL, "rope",
                    "D = 1026", "at most 1024");
    kt_op_attrs neg = rope_attrs(HALF, -2, 16);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &neg, &x3, 1, &y3, 1, NULL), KT_EINVAL, "rope",
                    "rotary_dim = -2");
    /* combinations and ranges */
    kt_op_attrs de = rope_attrs(HALF, 0, 16);
    de.rope_deinterleave = 1;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &de, &x3, 1, &y3, 1, NULL), KT_EINVAL, "rope",
                    "deinterleave = 1 needs interleaved = 1");
    kt_op_attrs yarn = yarn_attrs(HALF, 0, 16);
    yarn.rope_original_max_positions = 0;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &yarn, &x3, 1, &y3, 1, NULL), KT_EINVAL, "rope",
                    "yarn", "original_max_positions");
    kt_op_attrs th = rope_attrs(HALF, 0, 16);
    th.rope_theta = 0.5f;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &th, &x3, 1, &y3, 1, NULL), KT_EINVAL, "rope",
                    "theta = 0.5");
    kt_op_attrs mp = rope_attrs(HALF, 0, 0);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ROPE, &mp, &x3, 1, &y3, 1, NULL), KT_EINVAL, "rope",
                    "max_positions");
    /* positions take no gradient */
    kt_tensor gp[2] = {tu_new(KT_F32, 2, 3, 2, 8), pos_t};
    in[1] = pos_t;
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_ROPE, &at, in, 2, &y, 1, &y, gp, NULL), KT_EINVAL,
                    "rope", "input 1", "no gradient");
    tu_free(&x), tu_free(&y), tu_free(&pos_t), tu_free(&pos_bt), tu_free(&gin[0]);
    tu_free(&p4), tu_free(&p32), tu_free(&pf), tu_free(&x3), tu_free(&y3), tu_free(&xi);
    tu_free(&x2), tu_free(&x7), tu_free(&y7), tu_free(&xw), tu_free(&yw), tu_free(&gp[0]);
}

/* ---- the session path ---------------------------------------------------------------------- */

enum { ST = 6, SH = 3, SD = 16, SN = ST * SH * SD, SMAX = 64 };

/* x (param) [T,H,D], pos (input) [T]: ya = rope_a(x, pos) carries the loss ya . w (w an input
 * [N,1], so x's gradient is rope_a's backward of w exactly); yb = rope_b(x, pos) and
 * yc = rope_a(x) without positions are outputs. rope_a and rope_c share a table. */
static kt_program *session_program(const kt_op_attrs *a, const kt_op_attrs *b)
{
    kt_graph *g = NULL;
    kt_value x, pos, w, ya, yb, yc, flat, l, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_param(g, "x", KT_F32, 3, (int64_t[]){ST, SH, SD}, (kt_init){KT_INIT_ZEROS, 0, 0},
                      &x));
    OK(kt_graph_input(g, "pos", KT_I32, 1, (int64_t[]){ST}, &pos));
    OK(kt_graph_input(g, "w", KT_F32, 2, (int64_t[]){SN, 1}, &w));
    OK(kt_graph_op(g, "ya", KT_OP_ROPE, a, (kt_value[]){x, pos}, 2, &ya));
    OK(kt_graph_op(g, "yb", KT_OP_ROPE, b, (kt_value[]){x, pos}, 2, &yb));
    OK(kt_graph_op(g, "yc", KT_OP_ROPE, a, &x, 1, &yc));
    kt_op_attrs rs = kt_op_defaults(KT_OP_RESHAPE);
    rs.ndim = 2, rs.shape[0] = 1, rs.shape[1] = SN;
    OK(kt_graph_op(g, "flat", KT_OP_RESHAPE, &rs, &ya, 1, &flat));
    OK(kt_graph_op(g, "l", KT_OP_MATMUL, NULL, (kt_value[]){flat, w}, 2, &l));
    rs.ndim = 1, rs.shape[0] = 1;
    OK(kt_graph_op(g, "loss", KT_OP_RESHAPE, &rs, &l, 1, &loss));
    OK(kt_graph_set_loss(g, loss));
    OK(kt_graph_output(g, ya, "ya"));
    OK(kt_graph_output(g, yb, "yb"));
    OK(kt_graph_output(g, yc, "yc"));
    kt_program *p = NULL;
    OK(kt_compile(g, NULL, &p));
    kt_graph_destroy(g);
    return p;
}

static kt__rope_tables *rope_state_of(kt_session *s)
{
    for (int i = 0; i < s->n_stateful; i++)
        if (s->stateful[i].op == KT_OP_ROPE)
            return s->stateful[i].state;
    return NULL;
}

static kt_tensor session_get(kt_session *s, kt_tensor_role role, const char *name)
{
    kt_tensor t;
    OK(kt_session_tensor(s, role, name, &t));
    return t;
}

/* y = rope(x [, pos]) by a direct call, against the session's output named `name` */
static void expect_direct(const kt_op_attrs *at, const kt_tensor *in, int n_in,
                          const kt_tensor *got, const char *name)
{
    kt_tensor y = tu_clone(got);
    OK(kt_op_forward(KT_OP_ROPE, at, in, n_in, &y, 1, NULL));
    if (!tu_bitwise_equal(&y, got))
        fail_msg("%s: the session's output is not the direct call's, bit for bit", name);
    tu_free(&y);
}

static void test_session(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 20);
    const kt_op_attrs a = yarn_attrs(DEINTERLEAVE, 12, SMAX);
    kt_op_attrs b = rope_attrs(HALF, 0, SMAX);
    b.rope_theta = 500000.0f;
    kt_program *p = session_program(&a, &b);
    int64_t bound = 0; /* what a data loader checks positions against */
    OK(kt_program_index_bound(p, "pos", &bound));
    assert_int_equal(bound, SMAX);
    kt_session_options o = {.threads = 2, .optimizer = {.kind = KT_OPTIM_SGD, .lr = 0.1f}};
    kt_session *s = NULL;
    OK(kt_session_create(p, &o, &s));

    /* one table per distinct key, each the direct path's values bit for bit */
    const kt__rope_tables *st = rope_state_of(s);
    assert_non_null(st);
    assert_int_equal(st->n_tables, 2);
    const kt__rope_key keys[2] = {kt__rope_key_of(&a, SD), kt__rope_key_of(&b, SD)};
    for (int k = 0; k < 2; k++) {
        const kt__rope_table *t = kt__rope_find(st, &keys[k]);
        assert_non_null(t);
        kt__rope_freqs f;
        kt__rope_freqs_of(&keys[k], &f);
        float c[SD / 2], sn[SD / 2];
        for (int64_t pos = 0; pos < SMAX; pos++) {
            kt__rope_angles(&f, pos, c, sn);
            assert_memory_equal(t->cos + pos * t->half, c, (size_t)t->half * sizeof(float));
            assert_memory_equal(t->sin + pos * t->half, sn, (size_t)t->half * sizeof(float));
        }
    }

    kt_tensor x = session_get(s, KT_ROLE_PARAM, "x"), pos = session_get(s, KT_ROLE_INPUT, "pos");
    kt_tensor w = session_get(s, KT_ROLE_INPUT, "w");
    tu_fill_uniform(&x, &rng, -2, 2);
    tu_fill_uniform(&pos, &rng, 0, SMAX);
    tu_set(&pos, 0, SMAX - 1);
    tu_fill_uniform(&w, &rng, -1, 1);
    OK(kt_session_forward(s));
    kt_tensor xin[2] = {tu_clone(&x), tu_clone(&pos)};
    const char *const names[3] = {"ya", "yb", "yc"};
    const kt_op_attrs *const of[3] = {&a, &b, &a};
    for (int i = 0; i < 3; i++) {
        const kt_tensor got = session_get(s, KT_ROLE_OUTPUT, names[i]);
        expect_direct(of[i], xin, i == 2 ? 1 : 2, &got, names[i]);
    }

    /* x's gradient: rope_a's backward of w, as a direct call computes it */
    OK(kt_session_backward(s));
    kt_tensor gx = session_get(s, KT_ROLE_GRAD, "x");
    kt_tensor gw = tu_new(KT_F32, ST, SH, SD), dx = tu_clone(&gx), ya = tu_clone(&gx);
    memcpy(gw.data, w.data, kt_tensor_nbytes(&w));
    kt_tensor gin[2] = {dx, {0}};
    OK(kt_op_forward(KT_OP_ROPE, &a, xin, 2, &ya, 1, NULL));
    OK(kt_op_backward(KT_OP_ROPE, &a, xin, 2, &ya, 1, &gw, gin, NULL));
    if (!tu_bitwise_equal(&dx, &gx))
        fail_msg("x's gradient in the session is not the direct backward's, bit for bit");
    OK(kt_session_step(s));

    /* the steps read the table: a changed entry changes what they compute */
    kt__rope_table *ta = (kt__rope_table *)kt__rope_find(st, &keys[0]);
    const int64_t p0 = (int64_t)tu_get(&pos, 0);
    ta->cos[p0 * ta->half] = 0.0f, ta->sin[p0 * ta->half] = 1.0f; /* pair 0: a quarter turn */
    OK(kt_session_forward(s));
    kt_tensor yb2 = session_get(s, KT_ROLE_OUTPUT, "ya");
    for (int hd = 0; hd < SH; hd++) { /* token 0, head hd: pair 0 is (x0, x1) -> (y0, y6) */
        const int64_t h0 = hd * SD;
        assert_true(tu_get(&yb2, h0) == -tu_get(&x, h0 + 1));
        assert_true(tu_get(&yb2, h0 + 6) == tu_get(&x, h0));
    }

    /* a position out of range fails the step through the graph, forward and backward */
    tu_set(&pos, 3, SMAX);
    TU_EXPECT_ERROR(kt_session_forward(s), KT_EINVAL, "rope", "positions", "entry 3 = 64",
                    "max_positions = 64");
    tu_set(&pos, 3, 0);
    OK(kt_session_forward(s));
    tu_set(&pos, 5, -7);
    TU_EXPECT_ERROR(kt_session_backward(s), KT_EINVAL, "rope", "positions", "entry 5 = -7");

    tu_free(&xin[0]), tu_free(&xin[1]), tu_free(&gw), tu_free(&dx), tu_free(&ya);
    kt_session_destroy(s);
    kt_program_destroy(p);
}

/* loss = (ya * ya) . w with ya = rope_a(x, pos) inside a checkpoint segment when `segment`:
 * mul's backward needs ya, so rope's forward is recomputed (from the table) in backward. */
static kt_program *checkpoint_program(const kt_op_attrs *a, int segment)
{
    kt_graph *g = NULL;
    kt_value x, pos, w, ya, sq, flat, l, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_param(g, "x", KT_F32, 3, (int64_t[]){ST, SH, SD}, (kt_init){KT_INIT_ZEROS, 0, 0},
                      &x));
    OK(kt_graph_input(g, "pos", KT_I32, 1, (int64_t[]){ST}, &pos));
    OK(kt_graph_input(g, "w", KT_F32, 2, (int64_t[]){SN, 1}, &w));
    if (segment)
        OK(kt_graph_checkpoint_begin(g));
    OK(kt_graph_op(g, "ya", KT_OP_ROPE, a, (kt_value[]){x, pos}, 2, &ya));
    OK(kt_graph_op(g, "sq", KT_OP_MUL, NULL, (kt_value[]){ya, ya}, 2, &sq));
    if (segment) { /* the last segment is never recomputed: the loss gets one of its own */
        OK(kt_graph_checkpoint_end(g));
        OK(kt_graph_checkpoint_begin(g));
    }
    kt_op_attrs rs = kt_op_defaults(KT_OP_RESHAPE);
    rs.ndim = 2, rs.shape[0] = 1, rs.shape[1] = SN;
    OK(kt_graph_op(g, "flat", KT_OP_RESHAPE, &rs, &sq, 1, &flat));
    OK(kt_graph_op(g, "l", KT_OP_MATMUL, NULL, (kt_value[]){flat, w}, 2, &l));
    rs.ndim = 1, rs.shape[0] = 1;
    OK(kt_graph_op(g, "loss", KT_OP_RESHAPE, &rs, &l, 1, &loss));
    if (segment)
        OK(kt_graph_checkpoint_end(g));
    OK(kt_graph_set_loss(g, loss));
    kt_program *p = NULL;
    OK(kt_compile(g, NULL, &p));
    kt_graph_destroy(g);
    return p;
}

/* Checkpointing changes memory, never numbers: x's gradient is the same bits with rope
 * recomputed in backward as without. */
static void test_checkpoint(void **state)
{
    (void)state;
    const kt_op_attrs a = yarn_attrs(INTERLEAVED, 0, SMAX);
    kt_tensor grads[2];
    for (int segment = 0; segment < 2; segment++) {
        kt_program *p = checkpoint_program(&a, segment);
        int recomputed = 0;
        for (int32_t at = 0; at < p->n_steps; at++)
            recomputed += p->steps[at].op == KT_OP_ROPE && p->steps[at].kind == KT__STEP_FORWARD &&
                          (p->steps[at].flags & KT__STEP_RECOMPUTE);
        assert_int_equal(recomputed, segment);
        kt_session_options o = {.threads = 2};
        kt_session *s = NULL;
        OK(kt_session_create(p, &o, &s));
        tu_rng rng;
        tu_rng_seed(&rng, 30);
        kt_tensor x = session_get(s, KT_ROLE_PARAM, "x"), pos = session_get(s, KT_ROLE_INPUT, "pos");
        kt_tensor w = session_get(s, KT_ROLE_INPUT, "w");
        tu_fill_uniform(&x, &rng, -2, 2);
        tu_fill_uniform(&pos, &rng, 0, SMAX);
        tu_fill_uniform(&w, &rng, -1, 1);
        OK(kt_session_forward(s));
        OK(kt_session_backward(s));
        grads[segment] = tu_clone(&(kt_tensor[]){session_get(s, KT_ROLE_GRAD, "x")}[0]);
        kt_session_destroy(s);
        kt_program_destroy(p);
    }
    if (!tu_bitwise_equal(&grads[0], &grads[1]))
        fail_msg("x's gradient differs with rope recomputed under checkpointing");
    tu_free(&grads[0]), tu_free(&grads[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layouts),       cmocka_unit_test(test_scaling),
        cmocka_unit_test(test_known_values),  cmocka_unit_test(test_pair_norms),
        cmocka_unit_test(test_low_precision), cmocka_unit_test(test_deterministic),
        cmocka_unit_test(test_inplace),       cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_session),       cmocka_unit_test(test_checkpoint),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
