/* The MoE layer's SiLU epilogues: the elementwise steps between its GEMMs, fused with the
 * rounding to the compute dtype (silu_epilogue.c). */
#ifndef KT_KERNELS_SILU_EPILOGUE_H
#define KT_KERNELS_SILU_EPILOGUE_H

#include <stdint.h>

/* Elementwise steps of the layer on n contiguous f32 values, the results stored in the compute
 * dtype (bf16 when bf16, else f32); vectorised where the GEMMs are, the same operations for
 * every element whatever n, so any split of a buffer gives the same bytes.
 *   act_fwd: ac = silu(g) * u
 *   act_bwd: with ga = w * gap (gap: the down projection's input gradient for grad_y itself,
 *            w the row's routing weight): gg = ga * u * silu'(g), gu = ga * silu(g), and
 *            part[b] = sum of gap * ac over the values [16 b, 16 b + 16) (ac as act_fwd
 *            stores it): pieces of the routing gradient <grad_y, down(ac)> = <gap, ac>,
 *            summed per 16 values in a fixed order so that splits at multiples of 16 give
 *            the same pieces; with ac_out, ac stored there too (the bits act_fwd stores). */
void kt__moe_act_fwd(int64_t n, const float *g, const float *u, void *ac, int bf16);
/* dst = s * src in the compute dtype (s = 1: the plain conversion) */
void kt__moe_scale_store(int64_t n, const float *src, float s, void *dst, int bf16);
void kt__moe_act_bwd(int64_t n, const float *g, const float *u, const float *gap, float w,
                     void *ggc, void *guc, void *ac_out, float *part, int bf16);

#endif
