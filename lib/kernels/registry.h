/* The registry of GEMM kernel paths: one descriptor per path, in one table (registry.c), read by
 * the dispatch (bf16_gemm.c, f32_gemm.c), by the names the tools print and the tests check, and
 * by kt-bench's peaks (the instruction a path multiplies with). A path is chosen once per call
 * from the table: the first descriptor, in table order, that has a kernel for the product, whose
 * features the CPU has and whose row range holds the product's rows M. M is the rows of the
 * whole product (the same for every block and thread of it): paths sum in different orders, so
 * the choice never depends on the block a call computes. */
#ifndef KT_KERNELS_REGISTRY_H
#define KT_KERNELS_REGISTRY_H

#include <stddef.h>
#include <stdint.h>

/* The products: NT y = x w^T, NN y = g w, NN2 y = g0 w0 + g1 w1 (one sum), TN dw += s g^T x,
 * each on bf16 or f32 operands (f32 accumulation always); and MM, the dense matmul's
 * c = op(a) op(b) with either operand transposed in place (bf16 only; the MoE layer never asks
 * for it), and MM_MIXED, the same with one operand f32 and the other bf16 or f16 (widened
 * exactly: a LoRA fine-tune's f32 activations times its frozen bf16 weights). */
typedef enum kt__kprod {
    KT__KP_NT_BF16,
    KT__KP_NN_BF16,
    KT__KP_NN2_BF16,
    KT__KP_TN_BF16,
    KT__KP_NT_F32,
    KT__KP_NN_F32,
    KT__KP_NN2_F32,
    KT__KP_TN_F32,
    KT__KP_MM_BF16,
    KT__KP_MM_MIXED,
    KT__KP_NT_Q, /* quant_gemm.h's NT and NN on quantized weights (bf16 x and g) */
    KT__KP_NN_Q,
    KT__KPROD_COUNT
} kt__kprod;

/* The instruction a path multiplies with, and so the register peak it is judged against. */
typedef enum kt__kinsn {
    KT__KINSN_SCALAR, /* plain C: no peak */
    KT__KINSN_FMA,    /* vfmadd231ps, 16 x 2 flop at 512 bits, 8 x 2 at 256 (the path's
                       * bits): bf16 widened to f32, or f32 */
    KT__KINSN_DPBF16, /* vdpbf16ps, 16 x 4 flop */
    KT__KINSN_AMX,    /* tdpbf16ps on the AMX tiles */
    KT__KINSN_COUNT
} kt__kinsn;
extern const char *const kt__kinsn_names[KT__KINSN_COUNT];

/* What a path needs of the CPU: features, and the policy choices KT_CPU can force
 * (lib/core/cpu.c): BF16_ON_FMA, where bf16 multiplies faster widened (the vendor rule, or
 * KT_CPU=widen / dpbf16); F32_OWN, unless KT_CPU=blas sends f32 GEMMs to OpenBLAS. */
enum {
    KT__KF_AVX512 = 1u << 0,      /* avx512f + avx512bw */
    KT__KF_AVX512_BF16 = 1u << 1, /* and avx512_bf16 */
    KT__KF_AMX = 1u << 2,         /* AMX tiles usable (passed the start-up self-test) */
    KT__KF_BF16_ON_FMA = 1u << 3,
    KT__KF_F32_OWN = 1u << 4,
    KT__KF_AVX2 = 1u << 5, /* avx2 + fma + f16c (kt__cpu_has_avx2) */
};
/* This CPU's KT__KF_* bits (after KT_CPU). */
unsigned kt__kernel_features(void);

/* The kernels' signatures, those of bf16_gemm.h and f32_gemm.h; nt_bf16's `next` as
 * kt__bf16_gemm_nt_next's (a path that ignores it fetches nothing ahead). */
typedef void (*kt__nt_bf16_fn)(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,
                               int64_t ldx, const uint16_t *w, int64_t ldw, const uint16_t *next,
                               float *y, int64_t ldy, int accumulate);
typedef void (*kt__nn_bf16_fn)(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g,
                               int64_t ldg, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                               int accumulate);
typedef void (*kt__nn2_bf16_fn)(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g0,
                                const uint16_t *w0, const uint16_t *g1, const uint16_t *w1,
                                int64_t ldg, int64_t ldw, float *y, int64_t ldy, int stream);
typedef void (*kt__tn_bf16_fn)(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                               int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                               float scale, int accumulate, void *work);
typedef void (*kt__nt_f32_fn)(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *x,
                              int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,
                              int accumulate);
typedef void (*kt__nn2_f32_fn)(int64_t M, int64_t N, int64_t k0, int64_t k1, const float *g0,
                               const float *w0, const float *g1, const float *w1, int64_t ldg,
                               int64_t ldw, float *y, int64_t ldy, int accumulate);
typedef void (*kt__tn_f32_fn)(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *g,
                              int64_t ldg, const float *x, int64_t ldx, float *dw, int64_t lddw,
                              float scale, int accumulate, void *work);

typedef void (*kt__mm_bf16_fn)(int trans_a, int trans_b, int64_t M, int64_t n0, int64_t n1,
                               int64_t K, const uint16_t *a, int64_t lda, const uint16_t *b,
                               int64_t ldb, float *c, int64_t ldc, void *work);
/* The element types of MM_MIXED's operands. */
typedef enum kt__kelem { KT__KE_F32 = 0, KT__KE_BF16 = 1, KT__KE_F16 = 2 } kt__kelem;
typedef void (*kt__mm_mixed_fn)(kt__kelem ea, kt__kelem eb, int trans_a, int trans_b, int64_t M,
                                int64_t n0, int64_t n1, int64_t K, const void *a, int64_t lda,
                                const void *b, int64_t ldb, float *c, int64_t ldc, void *work);

/* The quantized products' signatures, quant_gemm.h's (kt__qmat: lib/kernels/quant.h). */
struct kt__qmat;
typedef void (*kt__nt_q_fn)(int64_t M, int64_t n0, int64_t n1, const uint16_t *x, int64_t ldx,
                            const struct kt__qmat *w, float *y, int64_t ldy, void *work);
typedef void (*kt__nn_q_fn)(int64_t M, int64_t c0, int64_t c1, const uint16_t *g0,
                            const struct kt__qmat *w0, const uint16_t *g1,
                            const struct kt__qmat *w1, int64_t ldg, float *y, int64_t ldy,
                            void *work);

/* Rows [min_m, max_m] a path serves for one product; max_m 0: not that product. */
typedef struct kt__krows {
    int64_t min_m, max_m;
} kt__krows;

typedef struct kt__kpath {
    const char *name;   /* what kt-bench prints and the tests compare */
    int sums_as;        /* index of the path whose sums (bits) it computes: itself, or the
                         * one it reads its operands differently from */
    kt__kinsn insn;     /* what it multiplies with */
    int bits;           /* at what vector width: 512 (zmm) or 256 (ymm); 0 for the scalar
                         * path and the AMX tiles (kt-bench times its peak at that width) */
    unsigned needs;     /* KT__KF_* for every product it serves */
    unsigned needs_bf16, needs_f32; /* and for its bf16 / f32 products */
    unsigned unless;    /* KT__KF_* whose presence rules it out (faster paths need them) */
    unsigned all_rows_without; /* features whose absence lets it serve every row count (the
                                * rows below min_m were left to a path that needs them) */
    kt__krows rows[KT__KPROD_COUNT];
    kt__nt_bf16_fn nt_bf16;
    kt__nn_bf16_fn nn_bf16;
    kt__nn2_bf16_fn nn2_bf16; /* nn_bf16 is nn2_bf16 with g1 = NULL where both are set */
    kt__tn_bf16_fn tn_bf16;
    kt__nt_f32_fn nt_f32;
    kt__nn2_f32_fn nn_f32; /* g1 NULL: one product */
    kt__tn_f32_fn tn_f32;
    kt__mm_bf16_fn mm_bf16; /* c[0:M, n0:n1) = op(a) op(b), overwritten (fma_gemm.h) */
    kt__mm_mixed_fn mm_mixed; /* the same, mixed operand types; its work is mm_work_bytes */
    kt__nt_q_fn nt_q;         /* quantized weights (quant_gemm.h) */
    kt__nn_q_fn nn_q;
    size_t (*tn_work_bytes)(int64_t M); /* the work buffer its TN wants (NULL: none) */
    size_t (*mm_work_bytes)(int64_t cols); /* the work buffer its MM wants for that many
                                            * columns (NULL: none; additive over blocks of
                                            * 32 columns) */
} kt__kpath;

/* The table, in order of preference; the last entry (the scalar references) serves every
 * product at every row count. */
extern const kt__kpath kt__kpaths[];
extern const int kt__kpath_count;

/* The path a product of M rows takes on this CPU. */
const kt__kpath *kt__kpath_pick(kt__kprod prod, int64_t M);
/* The largest work buffer any path's TN kernel of that product (KT__KP_TN_BF16 or _F32) needs
 * for M rows: the path is chosen per product, the buffer sized once per layer. */
size_t kt__kpath_tn_work_bytes(kt__kprod prod, int64_t M);
/* The name of the path whose sums that product computes (kt__kpath_pick's sums_as). */
const char *kt__kpath_sums_name(kt__kprod prod, int64_t M);

#endif
