/* What a session's optimizer trains inside a MoE layer. */
#ifndef KT_MOE_TRAINABLE_H
#define KT_MOE_TRAINABLE_H

#include <stdint.h>

#include "kt/moe.h"

/* The layer's trainable f32 values and their gradients, each one flat array in the same
 * order: the LoRA adapters (LoRA mode) or the expert weights (full mode with f32 weights).
 * Returns their count; 0 when nothing is trained (frozen); -1 when the layer trains bf16
 * weights, which need f32 master copies this layer does not keep. */
int64_t kt__moe_trainable(kt_moe *m, float **param_out, float **grad_out);

#endif
