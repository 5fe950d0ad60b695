/* Masks of the first n lanes of an AVX-512 vector (all of them from 16 or 32 on, none at 0 or
 * below): the row and column edges of the kernels in lib/kernels. Plain integer code, usable
 * without a target attribute. */
#ifndef KT_KERNELS_LANE_MASK_H
#define KT_KERNELS_LANE_MASK_H

#include <stdint.h>

static inline uint16_t kt__lanes16(int64_t n)
{
    return n >= 16 ? (uint16_t)0xffffu : n <= 0 ? (uint16_t)0 : (uint16_t)((1u << n) - 1u);
}

static inline uint32_t kt__lanes32(int64_t n)
{
    return n >= 32 ? 0xffffffffu : n <= 0 ? 0u : (uint32_t)((1u << n) - 1u);
}

#endif
