/* AMX bf16 GEMMs for the MoE layer: the feature check, the packing routines (AVX-512) and the
 * tile kernels (kernels/amx_gemm_kernels.h, instantiated here on the real tiles). Layouts, packing
 * and the order of summation are described in kernels/amx_gemm.h.
 *
 * Everything is compiled with target attributes (the library needs no -m flags): the packers
 * for AVX-512 F/BW, the kernels for AMX-TILE + AMX-BF16 on top. The tile intrinsics take tile
 * numbers as literal constants (gcc pastes them into inline assembly, clang into builtins).
 *
 * gcc's tile intrinsics are inline assembly that does not tell the compiler that tileloadd
 * reads memory (only tilestored has a "memory" clobber), so a plain store into a packing
 * buffer could be moved past, or dropped before, the tileloadd that reads it. Each load is
 * therefore fenced by compiler barriers (no instructions) on both sides; with clang, whose
 * intrinsics are builtins that do describe their memory access, the barriers cost nothing. */
#include <pthread.h>

#include "lib/core/cpu_internal.h"
#include "kt/runtime.h"
#include "lib/kernels/amx_gemm.h"
#include "lib/kernels/bf16_gemm.h"
#include "lib/kernels/lane_mask.h"

#ifdef KT_AMX_COMPILED
#include <cpuid.h>
#include <immintrin.h>

#define AMX_VEC __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define AMX_VEC_INLINE                                                                             \
    static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512bf16")))

/* ---- feature check ------------------------------------------------------------------------ */

static int amx_ok;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

/* Palette 1 must offer what the kernels configure (cpuid leaf 0x1D: 8 tiles of 16 rows x 64
 * bytes) and the TMUL unit must take such tiles (leaf 0x1E: K up to 16 rows, N up to 64 bytes).
 * Every AMX CPU so far does; the check only keeps a future, different one off these kernels. */
static int palette_ok(void)
{
    if (__get_cpuid_max(0, NULL) < 0x1e)
        return 0;
    unsigned a, b, c, d;
    __cpuid_count(0x1d, 0, a, b, c, d);
    if (a < 1) /* max palette */
        return 0;
    __cpuid_count(0x1d, 1, a, b, c, d);
    const unsigned bytes_per_tile = a >> 16, bytes_per_row = b & 0xffff, max_names = b >> 16,
                   max_rows = c & 0xffff;
    if (bytes_per_tile < 1024 || bytes_per_row < 64 || max_names < 8 || max_rows < 16)
        return 0;
    __cpuid_count(0x1e, 0, a, b, c, d);
    const unsigned tmul_maxk = b & 0xff, tmul_maxn = (b >> 8) & 0xffff;
    return tmul_maxk >= 16 && tmul_maxn >= 64;
}

static void amx_detect(void)
{
    /* kt_cpu_get_features() makes the arch_prctl(ARCH_REQ_XCOMP_PERM) request; amx_usable
     * is its answer (and 0 under KT_CPU=portable). */
    const kt_cpu_features *f = kt_cpu_get_features();
    amx_ok = f->amx_usable && f->amx_tile && f->amx_bf16 && kt__cpu_has_avx512() &&
             kt__cpu_has_avx512_bf16() && palette_ok();
    if (amx_ok && !kt__amx_selftest(kt__amx_gemm_nt, kt__amx_gemm_nn, kt__amx_gemm_tn))
        amx_ok = -1; /* present, but the kernels disagree with the reference here */
}

int kt__amx_state(void)
{
    pthread_once(&amx_once, amx_detect);
    return amx_ok;
}

int kt__amx_usable(void) { return kt__amx_state() == 1; }

/* ---- packing ------------------------------------------------------------------------------ */

/* Interleaves elements 0..15 (LO) or 16..31 (HI) of two rows: r0[i], r1[i], r0[i+1], ... */
#define AMX_IDX_LO                                                                                 \
    _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,   \
                     37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0)
#define AMX_IDX_HI                                                                                 \
    _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54,   \
                     22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16)

/* out[p] dword i = in[i] dword p: a 16 x 16 transpose of 32-bit elements (unpack within
 * 128-bit lanes, then a 4 x 4 transpose of the lanes), stored as one tile. */
AMX_VEC_INLINE void transpose_store(const __m512i in[16], uint16_t *tile)
{
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
    }
    /* b[4q + j], lane L = rows 4q..4q+3 at column 4L + j */
    for (int q = 0; q < 4; q++) {
        const __m512i *t = a + 4 * q;
        b[4 * q + 0] = _mm512_unpacklo_epi64(t[0], t[2]);
        b[4 * q + 1] = _mm512_unpackhi_epi64(t[0], t[2]);
        b[4 * q + 2] = _mm512_unpacklo_epi64(t[1], t[3]);
        b[4 * q + 3] = _mm512_unpackhi_epi64(t[1], t[3]);
    }
    /* row 4L + j = lane L of b[j], b[4 + j], b[8 + j], b[12 + j] */
    for (int j = 0; j < 4; j++) {
        const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x44),
                      c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xee),
                      c2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x44),
                      c3 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xee);
        _mm512_storeu_si512((void *)(tile + (0 + j) * 32), _mm512_shuffle_i32x4(c0, c2, 0x88));
        _mm512_storeu_si512((void *)(tile + (4 + j) * 32), _mm512_shuffle_i32x4(c0, c2, 0xdd));
        _mm512_storeu_si512((void *)(tile + (8 + j) * 32), _mm512_shuffle_i32x4(c1, c3, 0x88));
        _mm512_storeu_si512((void *)(tile + (12 + j) * 32), _mm512_shuffle_i32x4(c1, c3, 0xdd));
    }
}

AMX_VEC void kt__amx_pack_a(const uint16_t *src, int64_t ld, int64_t rows, int64_t cols,
                            uint16_t *tile)
{
    const __mmask32 m = kt__lanes32(cols);
    for (int64_t r = 0; r < 16; r++) {
        const __m512i v =
            r < rows && m ? _mm512_maskz_loadu_epi16(m, src + r * ld) : _mm512_setzero_si512();
        _mm512_storeu_si512((void *)(tile + r * 32), v);
    }
}

AMX_VEC void kt__amx_pack_b_nt(const uint16_t *w, int64_t ldw, int64_t ncols, int64_t nred,
                               int64_t steps, int tiles, uint16_t *panel)
{
    for (int64_t s = 0; s < steps; s++) {
        const __mmask32 km = kt__lanes32(nred - 32 * s);
        for (int t = 0; t < tiles; t++) {
            __m512i rows[16];
            for (int i = 0; i < 16; i++) {
                const int64_t c = 16 * t + i;
                rows[i] = c < ncols && km ? _mm512_maskz_loadu_epi16(km, w + c * ldw + 32 * s)
                                          : _mm512_setzero_si512();
            }
            transpose_store(rows, panel + (s * tiles + t) * KT_AMX_TILE_ELEMS);
        }
    }
}

AMX_VEC void kt__amx_pack_b_pairs(const uint16_t *src, int64_t ld, int64_t nred, int64_t ncols,
                                  int64_t steps, int tiles, uint16_t *panel)
{
    const __m512i lo = AMX_IDX_LO, hi = AMX_IDX_HI, z = _mm512_setzero_si512();
    const __mmask32 cm = kt__lanes32(ncols);
    for (int64_t s = 0; s < steps; s++) {
        uint16_t *t0 = panel + s * tiles * KT_AMX_TILE_ELEMS;
        for (int64_t p = 0; p < 16; p++) {
            const int64_t i = 32 * s + 2 * p;
            const __m512i r0 = i < nred && cm ? _mm512_maskz_loadu_epi16(cm, src + i * ld) : z;
            const __m512i r1 =
                i + 1 < nred && cm ? _mm512_maskz_loadu_epi16(cm, src + (i + 1) * ld) : z;
            _mm512_storeu_si512((void *)(t0 + p * 32), _mm512_permutex2var_epi16(r0, lo, r1));
            if (tiles > 1)
                _mm512_storeu_si512((void *)(t0 + KT_AMX_TILE_ELEMS + p * 32),
                                    _mm512_permutex2var_epi16(r0, hi, r1));
        }
    }
}

AMX_VEC void kt__amx_pack_a_tn(const uint16_t *g, int64_t ldg, int64_t nred, int64_t nrows,
                               int64_t steps, int tiles, uint16_t *panel)
{
    const __m512i lo = AMX_IDX_LO, z = _mm512_setzero_si512();
    for (int64_t s = 0; s < steps; s++)
        for (int t = 0; t < tiles; t++) {
            const int64_t left = nrows - 16 * t;
            const __mmask32 cm = kt__lanes32(left < 16 ? left : 16);
            __m512i pairs[16]; /* dword r of pairs[p] = (g[32s + 2p, 16t + r], g[.. + 1, ..]) */
            for (int p = 0; p < 16; p++) {
                const int64_t m = 32 * s + 2 * p;
                const uint16_t *gp = g + m * ldg + 16 * t;
                const __m512i r0 = m < nred && cm ? _mm512_maskz_loadu_epi16(cm, gp) : z;
                const __m512i r1 = m + 1 < nred && cm ? _mm512_maskz_loadu_epi16(cm, gp + ldg) : z;
                pairs[p] = _mm512_permutex2var_epi16(r0, lo, r1);
            }
            transpose_store(pairs, panel + (s * tiles + t) * KT_AMX_TILE_ELEMS);
        }
}

/* ---- the kernels on the real tiles ---------------------------------------------------------- */

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
#define AMX_BARRIER() __asm__ volatile("" ::: "memory")

#define AMXK_FN(name) amx_##name
#define AMXK_TARGET AMX_TARGET
#define AMXK_CFG(cfg)                                                                              \
    do {                                                                                           \
        AMX_BARRIER();                                                                             \
        _tile_loadconfig(cfg);                                                                     \
    } while (0)
#define AMXK_ZERO(t) _tile_zero(t)
#define AMXK_LOAD(t, p, bytes)                                                                     \
    do {                                                                                           \
        AMX_BARRIER();                                                                             \
        _tile_loadd(t, p, bytes);                                                                  \
        AMX_BARRIER();                                                                             \
    } while (0)
#define AMXK_STORE(t, p, bytes)                                                                    \
    do {                                                                                           \
        _tile_stored(t, p, bytes);                                                                 \
        AMX_BARRIER();                                                                             \
    } while (0)
#define AMXK_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define AMXK_RELEASE() _tile_release()

#include "lib/kernels/amx_gemm_kernels.h"

void kt__amx_gemm_nt(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x, int64_t ldx,
                     const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    amx_gemm_ab(1, M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
}

void kt__amx_gemm_nn(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g, int64_t ldg,
                     const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    amx_gemm_ab(0, M, k0, k1, N, g, ldg, w, ldw, y, ldy, accumulate);
}

void kt__amx_gemm_tn(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g, int64_t ldg,
                     const uint16_t *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                     int accumulate)
{
    amx_gemm_tn(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate);
}

#else /* !KT_AMX_COMPILED: no AMX on this target; the names run the scalar reference */

int kt__amx_usable(void) { return 0; }
int kt__amx_state(void) { return 0; }

void kt__amx_gemm_nt(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x, int64_t ldx,
                     const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    kt__bf16_gemm_nt_ref(M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
}

void kt__amx_gemm_nn(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g, int64_t ldg,
                     const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    kt__bf16_gemm_nn_ref(M, N, k0, k1, g, ldg, w, ldw, y, ldy, accumulate);
}

void kt__amx_gemm_tn(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g, int64_t ldg,
                     const uint16_t *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                     int accumulate)
{
    kt__bf16_gemm_tn_ref(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate);
}

#endif

void kt__amx_gemm_tn_acc(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                         int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                         float scale)
{
    kt__amx_gemm_tn(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, 1);
}
