/* f32 <-> bf16 and f32 <-> f16 against a reference written here in double arithmetic
 * (frexp/ldexp, explicit ties-to-even on the scaled value), not in the library's bit
 * tricks; then the vector entry points against the scalar ones, bit for bit. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/support/test_util.h"

/* ---- the reference ------------------------------------------------------------------------- */

typedef struct fmt {
    const char *name;
    int mbits; /* stored mantissa bits */
    int ebits; /* exponent bits */
    int quiet_on_widen; /* f16 -> f32 sets the quiet bit (as F16C does); bf16 widens by shift */
} fmt;

static const fmt BF16 = {"bf16", 7, 8, 0};
static const fmt F16 = {"f16", 10, 5, 1};

static uint32_t bits_of(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float float_of(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* f32 -> narrow format: NaN keeps its sign and top payload bits and is made quiet; other
 * values are rounded to nearest, ties to even, on the grid of the value's binade (or the
 * subnormal grid), and go to infinity at or beyond 2^(emax+1). */
static uint16_t ref_narrow(const fmt *f, uint32_t u)
{
    const int bias = (1 << (f->ebits - 1)) - 1, emin = 1 - bias, emax = bias;
    const uint32_t expmask = ((1u << f->ebits) - 1) << f->mbits;
    const uint16_t sign = (uint16_t)((u >> 31) << (f->mbits + f->ebits));
    float x = float_of(u);
    if (isnan(x))
        return (uint16_t)(sign | expmask | (1u << (f->mbits - 1)) |
                          ((u & 0x7fffffu) >> (23 - f->mbits)));
    if (isinf(x))
        return (uint16_t)(sign | expmask);
    double ax = fabs((double)x);
    if (ax == 0.0)
        return sign;
    int e;
    (void)frexp(ax, &e);
    int top = e - 1; /* ax = 1.m * 2^top */
    double quantum = ldexp(1.0, (top < emin ? emin : top) - f->mbits);
    double r = ax / quantum; /* exact: scaling by a power of two */
    double fl = floor(r), frac = r - fl;
    if (frac > 0.5 || (frac == 0.5 && fmod(fl, 2.0) == 1.0))
        fl += 1.0;
    double v = fl * quantum;
    if (v >= ldexp(1.0, emax + 1))
        return (uint16_t)(sign | expmask);
    if (v == 0.0)
        return sign;
    (void)frexp(v, &e);
    top = e - 1;
    if (top < emin)
        return (uint16_t)(sign | (uint32_t)(v / ldexp(1.0, emin - f->mbits)));
    uint32_t mant = (uint32_t)(v / ldexp(1.0, top - f->mbits)) - (1u << f->mbits);
    return (uint16_t)(sign | ((uint32_t)(top + bias) << f->mbits) | mant);
}

/* narrow format -> f32: the value, exactly (every bf16/f16 value is an f32 value). */
static uint32_t ref_widen(const fmt *f, uint16_t h)
{
    const int bias = (1 << (f->ebits - 1)) - 1;
    const uint32_t emax_field = (1u << f->ebits) - 1;
    uint32_t sign = ((uint32_t)h >> (f->mbits + f->ebits)) & 1u;
    uint32_t ef = ((uint32_t)h >> f->mbits) & emax_field;
    uint32_t mant = (uint32_t)h & ((1u << f->mbits) - 1);
    if (ef == emax_field) {
        uint32_t r = (sign << 31) | 0x7f800000u | (mant << (23 - f->mbits));
        if (mant != 0 && f->quiet_on_widen)
            r |= 0x00400000u;
        return r;
    }
    double v = ef == 0 ? ldexp((double)mant, 1 - bias - f->mbits)
                       : ldexp((double)(mant | (1u << f->mbits)), (int)ef - bias - f->mbits);
    float x = (float)v;
    assert_true((double)x == v);
    return bits_of(sign ? -x : x);
}

static uint16_t lib_narrow(const fmt *f, float x)
{
    return f == &BF16 ? kt_f32_to_bf16_1(x) : kt_f32_to_f16_1(x);
}

static float lib_widen(const fmt *f, uint16_t h)
{
    return f == &BF16 ? kt_bf16_to_f32_1(h) : kt_f16_to_f32_1(h);
}

static void check_narrow(const fmt *f, uint32_t u)
{
    uint16_t want = ref_narrow(f, u), got = lib_narrow(f, float_of(u));
    if (want != got)
        fail_msg("f32 %08x -> %s: got %04x, expected %04x", u, f->name, got, want);
}

/* ---- hand-picked values ---------------------------------------------------------------------- */

typedef struct pair {
    uint32_t f32;
    uint16_t want;
} pair;

/* Each expectation is spelled out, so the reference itself is checked too. */
static const pair bf16_cases[] = {
    {0x00000000u, 0x0000}, {0x80000000u, 0x8000},   /* +-0 */
    {0x7f800000u, 0x7f80}, {0xff800000u, 0xff80},   /* +-Inf */
    {0x7fc00000u, 0x7fc0}, {0x7f800001u, 0x7fc0},   /* qNaN; sNaN quieted */
    {0x7fa5a5a5u, 0x7fe5}, {0xffb00000u, 0xfff0},   /* payloads, sign kept */
    {0x7fffffffu, 0x7fff}, {0xff800001u, 0xffc0},
    {0x3f800000u, 0x3f80},                          /* 1 */
    {0x3f808000u, 0x3f80}, {0x3f818000u, 0x3f82},   /* ties to even */
    {0x3f808001u, 0x3f81}, {0x3f807fffu, 0x3f80},   /* just above / below the tie */
    {0xbf818000u, 0xbf82},                          /* negative tie */
    {0x7f7f0000u, 0x7f7f},                          /* largest bf16 */
    {0x7f7f7fffu, 0x7f7f}, {0x7f7f8000u, 0x7f80},   /* overflow threshold (tie, odd) */
    {0x7f7fffffu, 0x7f80}, {0xff7fffffu, 0xff80},   /* FLT_MAX overflows */
    {0x00800000u, 0x0080},                          /* smallest normal */
    {0x00000001u, 0x0000}, {0x80000001u, 0x8000},   /* smallest subnormal -> 0 */
    {0x00008000u, 0x0000}, {0x00018000u, 0x0002},   /* subnormal ties */
    {0x00010000u, 0x0001}, {0x007fffffu, 0x0080},   /* subnormal, rounds up to normal */
};

static const pair f16_cases[] = {
    {0x00000000u, 0x0000}, {0x80000000u, 0x8000},
    {0x7f800000u, 0x7c00}, {0xff800000u, 0xfc00},
    {0x7fc00000u, 0x7e00}, {0x7f800001u, 0x7e00},   /* sNaN with low payload: quiet */
    {0x7f802000u, 0x7e01}, {0xffc00000u, 0xfe00},
    {0x7fffffffu, 0x7fff}, {0x7fa5a5a5u, 0x7f2d},
    {0x3f800000u, 0x3c00},                          /* 1 */
    {0x3f801000u, 0x3c00}, {0x3f803000u, 0x3c02},   /* ties to even */
    {0x3f801001u, 0x3c01},
    {0x477fe000u, 0x7bff},                          /* 65504: largest f16 */
    {0x477fef00u, 0x7bff},                          /* 65519 */
    {0x477fefffu, 0x7bff},                          /* 65519.998 */
    {0x477ff000u, 0x7c00}, {0xc77ff000u, 0xfc00},   /* +-65520: ties up to Inf */
    {0x47800000u, 0x7c00}, {0x501502f9u, 0x7c00},   /* 65536, 1e10 */
    {0x38800000u, 0x0400},                          /* 2^-14 smallest normal */
    {0x387fc000u, 0x03ff},                          /* largest subnormal */
    {0x387fe000u, 0x0400},                          /* tie between it and 2^-14 */
    {0x33800000u, 0x0001}, {0xb3800000u, 0x8001},   /* 2^-24 smallest subnormal */
    {0x33000000u, 0x0000}, {0x33000001u, 0x0001},   /* 2^-25: tie to 0; just above */
    {0x33c00000u, 0x0002}, {0x34200000u, 0x0002},   /* 1.5 and 2.5 units: ties to even */
    {0x32ffffffu, 0x0000}, {0x00000001u, 0x0000},
};

static void test_special_values(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof bf16_cases / sizeof bf16_cases[0]; i++) {
        uint32_t u = bf16_cases[i].f32;
        if (ref_narrow(&BF16, u) != bf16_cases[i].want)
            fail_msg("reference bf16 of %08x is %04x, table says %04x", u, ref_narrow(&BF16, u),
                     bf16_cases[i].want);
        check_narrow(&BF16, u);
    }
    for (size_t i = 0; i < sizeof f16_cases / sizeof f16_cases[0]; i++) {
        uint32_t u = f16_cases[i].f32;
        if (ref_narrow(&F16, u) != f16_cases[i].want)
            fail_msg("reference f16 of %08x is %04x, table says %04x", u, ref_narrow(&F16, u),
                     f16_cases[i].want);
        check_narrow(&F16, u);
    }
    /* widening of the specials */
    assert_int_equal(bits_of(kt_f16_to_f32_1(0x7bff)), 0x477fe000u);
    assert_int_equal(bits_of(kt_f16_to_f32_1(0x0001)), 0x33800000u);
    assert_int_equal(bits_of(kt_f16_to_f32_1(0x8000)), 0x80000000u);
    assert_int_equal(bits_of(kt_f16_to_f32_1(0xfc00)), 0xff800000u);
    assert_int_equal(bits_of(kt_bf16_to_f32_1(0x0001)), 0x00010000u);
    assert_int_equal(bits_of(kt_bf16_to_f32_1(0xff80)), 0xff800000u);
    assert_true(isnan(kt_f16_to_f32_1(0x7c01)));
    assert_true(isnan(kt_bf16_to_f32_1(0x7f81)));
}

/* Every bf16 and every f16 value widens to exactly its value. */
static void test_widen_exhaustive(void **state)
{
    (void)state;
    const fmt *fmts[2] = {&BF16, &F16};
    for (int k = 0; k < 2; k++) {
        for (uint32_t h = 0; h <= 0xffff; h++) {
            uint32_t want = ref_widen(fmts[k], (uint16_t)h);
            uint32_t got = bits_of(lib_widen(fmts[k], (uint16_t)h));
            if (want != got)
                fail_msg("%s %04x -> f32: got %08x, expected %08x", fmts[k]->name, h, got, want);
        }
    }
}

/* The hard cases: every midpoint between neighbouring representable values (where ties to
 * even decides), one f32 ulp either side of it, and every representable value itself. */
static void test_midpoints(void **state)
{
    (void)state;
    const fmt *fmts[2] = {&BF16, &F16};
    for (int k = 0; k < 2; k++) {
        const fmt *f = fmts[k];
        const uint32_t finite_top = ((1u << f->ebits) - 1) << f->mbits; /* +Inf's bits */
        for (uint32_t s = 0; s < 2; s++) {
            for (uint32_t h = 0; h < finite_top; h++) {
                uint16_t hb = (uint16_t)(h | (s << (f->mbits + f->ebits)));
                double lo = (double)float_of(ref_widen(f, hb));
                /* the next value away from zero, or 2^(emax+1) past the largest finite */
                double hi = h + 1 < finite_top
                                ? (double)float_of(ref_widen(f, (uint16_t)(hb + 1)))
                                : (s ? -1.0 : 1.0) * ldexp(1.0, 1 << (f->ebits - 1));
                double mid = (lo + hi) / 2;
                float m = (float)mid;
                assert_true((double)m == mid); /* midpoints are f32 values */
                uint32_t mu = bits_of(m);
                check_narrow(f, bits_of((float)lo));
                check_narrow(f, mu);
                check_narrow(f, mu + 1);
                if ((mu & 0x7fffffffu) != 0)
                    check_narrow(f, mu - 1);
            }
        }
    }
}

static uint32_t random_f32_bits(tu_rng *rng)
{
    uint64_t r = tu_rng_next(rng);
    uint32_t u = (uint32_t)(r >> 32);
    switch ((r >> 8) & 3) {
    case 0: /* any pattern: NaNs, infinities, all exponents */
        return u;
    case 1: /* exponents around f16's range, subnormals and overflow included */
        return (u & 0x807fffffu) | ((uint32_t)(95 + (r & 63)) << 23);
    case 2: /* f32 subnormals and tiny values */
        return u & 0x80ffffffu;
    default: /* low mantissa bits near a tie for both formats */
        return (u & 0xffffe000u) | ((r & 1) ? 0x1000u : 0x8000u) | ((u >> 3) & 1u);
    }
}

static void test_random_patterns(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 42);
    for (int i = 0; i < 2000000; i++) {
        uint32_t u = random_f32_bits(&rng);
        check_narrow(&BF16, u);
        check_narrow(&F16, u);
    }
}

/* ---- vector entry points -------------------------------------------------------------------- */

static float *random_floats(size_t n, tu_rng *rng)
{
    float *x = malloc(n * sizeof *x + 64);
    assert_non_null(x);
    for (size_t i = 0; i < n; i++)
        x[i] = float_of(random_f32_bits(rng));
    /* and the hand-picked values, somewhere inside the vector body */
    size_t at = n / 3;
    for (size_t i = 0; i < sizeof bf16_cases / sizeof bf16_cases[0] && at < n; i++, at++)
        x[at] = float_of(bf16_cases[i].f32);
    for (size_t i = 0; i < sizeof f16_cases / sizeof f16_cases[0] && at < n; i++, at++)
        x[at] = float_of(f16_cases[i].f32);
    return x;
}

static uint16_t *random_halves(size_t n, tu_rng *rng)
{
    uint16_t *h = malloc(n * sizeof *h + 64);
    assert_non_null(h);
    for (size_t i = 0; i < n; i++)
        h[i] = (uint16_t)(tu_rng_next(rng) >> 48);
    return h;
}

/* Runs each vector function on x[off .. off+n) and compares with the scalar form. */
static void compare_vector(const float *x, const uint16_t *h, size_t n)
{
    uint16_t *o16 = malloc(n * sizeof *o16 + 2);
    float *o32 = malloc(n * sizeof *o32 + 4);
    assert_non_null(o16);
    assert_non_null(o32);
    kt_f32_to_bf16(o16, x, n);
    for (size_t i = 0; i < n; i++)
        if (o16[i] != kt_f32_to_bf16_1(x[i]))
            fail_msg("kt_f32_to_bf16 (n=%zu) element %zu: f32 %08x -> %04x, scalar %04x", n, i,
                     bits_of(x[i]), o16[i], kt_f32_to_bf16_1(x[i]));
    kt_f32_to_f16(o16, x, n);
    for (size_t i = 0; i < n; i++)
        if (o16[i] != kt_f32_to_f16_1(x[i]))
            fail_msg("kt_f32_to_f16 (n=%zu) element %zu: f32 %08x -> %04x, scalar %04x", n, i,
                     bits_of(x[i]), o16[i], kt_f32_to_f16_1(x[i]));
    kt_bf16_to_f32(o32, h, n);
    for (size_t i = 0; i < n; i++)
        if (bits_of(o32[i]) != bits_of(kt_bf16_to_f32_1(h[i])))
            fail_msg("kt_bf16_to_f32 (n=%zu) element %zu: bf16 %04x -> %08x, scalar %08x", n, i,
                     h[i], bits_of(o32[i]), bits_of(kt_bf16_to_f32_1(h[i])));
    kt_f16_to_f32(o32, h, n);
    for (size_t i = 0; i < n; i++)
        if (bits_of(o32[i]) != bits_of(kt_f16_to_f32_1(h[i])))
            fail_msg("kt_f16_to_f32 (n=%zu) element %zu: f16 %04x -> %08x, scalar %08x", n, i,
                     h[i], bits_of(o32[i]), bits_of(kt_f16_to_f32_1(h[i])));
    free(o16);
    free(o32);
}

static void test_vector_matches_scalar(void **state)
{
    (void)state;
    const kt_cpu_features *cf = kt_cpu_get_features();
    print_message("conversion paths: bf16 %s, f16 %s\n",
                  cf->avx512f && cf->avx512bw ? "avx512" : "scalar",
                  cf->avx2 && cf->f16c ? "f16c" : "scalar");
    tu_rng rng;
    tu_rng_seed(&rng, 7);
    const size_t n = 1000003;
    float *x = random_floats(n, &rng);
    uint16_t *h = random_halves(n, &rng);
    compare_vector(x, h, n);
    /* every 16-bit pattern through the vector widening */
    for (uint32_t i = 0; i < 65536; i++)
        h[i] = (uint16_t)i;
    compare_vector(x, h, 65536);
    /* short lengths and unaligned starts, for the tails */
    for (size_t off = 0; off < 4; off++)
        for (size_t len = 0; len <= 49; len++)
            compare_vector(x + off, h + off, len);
    free(x);
    free(h);
}

/* ---- round trips ------------------------------------------------------------------------------ */

static void test_round_trips(void **state)
{
    (void)state;
    uint16_t *h = malloc(65536 * sizeof *h), *back = malloc(65536 * sizeof *back);
    float *f = malloc(65536 * sizeof *f);
    assert_non_null(h);
    assert_non_null(back);
    assert_non_null(f);
    for (uint32_t i = 0; i < 65536; i++)
        h[i] = (uint16_t)i;
    const fmt *fmts[2] = {&BF16, &F16};
    for (int k = 0; k < 2; k++) {
        const fmt *fm = fmts[k];
        if (fm == &BF16) {
            kt_bf16_to_f32(f, h, 65536);
            kt_f32_to_bf16(back, f, 65536);
        } else {
            kt_f16_to_f32(f, h, 65536);
            kt_f32_to_f16(back, f, 65536);
        }
        const uint32_t expmask = ((1u << fm->ebits) - 1) << fm->mbits;
        for (uint32_t i = 0; i < 65536; i++) {
            int nan = (i & expmask) == expmask && (i & ((1u << fm->mbits) - 1)) != 0;
            if (nan) {
                /* stays a NaN (quiet, same sign) */
                assert_true(isnan(f[i]));
                uint32_t sign = 1u << (fm->mbits + fm->ebits);
                assert_int_equal(back[i] & sign, i & sign);
                assert_int_equal(back[i] & expmask, expmask);
                assert_true(back[i] & (1u << (fm->mbits - 1)));
                continue;
            }
            if (back[i] != i)
                fail_msg("%s %04x -> f32 %08x -> %04x", fm->name, i, bits_of(f[i]), back[i]);
            uint16_t s = lib_narrow(fm, lib_widen(fm, (uint16_t)i));
            if (s != i)
                fail_msg("%s scalar round trip of %04x gives %04x", fm->name, i, s);
        }
    }
    free(h);
    free(back);
    free(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_special_values),     cmocka_unit_test(test_widen_exhaustive),
        cmocka_unit_test(test_midpoints),          cmocka_unit_test(test_random_patterns),
        cmocka_unit_test(test_vector_matches_scalar), cmocka_unit_test(test_round_trips),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
