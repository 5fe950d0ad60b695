/* What a session's optimizer trains inside a MoE layer. */
#ifndef KT_MOE_TRAINABLE_H
#define KT_MOE_TRAINABLE_H

#include <stdint.h>

#include "kt/io.h"
#include "kt/moe.h"

/* The layer's trainable f32 values and their gradients, each one flat array in the same
 * order: the LoRA adapters (LoRA mode) or the expert weights (full mode with f32 weights).
 * Returns their count; 0 when nothing is trained (frozen); -1 when the layer trains bf16
 * weights, which need f32 master copies this layer does not keep. */
int64_t kt__moe_trainable(kt_moe *m, float **param_out, float **grad_out);

/* ---- the layer's tensors in a session's checkpoint (session_io.c) ---- */

#define KT__MOE_NAME_BYTES 512 /* room for each name kt__moe_st_items writes */

/* Where a layer's tensors are in a file: under `prefix` with Hugging Face's projection names
 * ("<prefix>experts.<e>.gate_proj.weight"), or with prefix NULL by kt_moe_tensor_name(names,
 * layer, ...). */
typedef struct kt__moe_naming {
    const char *prefix;
    kt_moe_names names;
    int layer;
} kt__moe_naming;

/* The names' common start for a layer's experts: "model.layers.3.mlp.experts." (KT_ERANGE when
 * size is too small). */
kt_status kt__moe_names_prefix(kt_moe_names names, int layer, char *buf, size_t size);
/* The layer's own names (its config's names and layer). */
kt__moe_naming kt__moe_own_naming(const kt_moe *moe);

/* Whether `name` is one of the tensors the layer loads under `naming`: an expert's weight
 * (expert < E), or in LoRA mode one of its adapters. */
int kt__moe_names_tensor(const kt_moe *moe, const kt__moe_naming *naming, const char *name);

/* How many tensors kt__moe_st_items lists: every expert's gate/up/down weight (and its two
 * LoRA adapters in LoRA mode). */
size_t kt__moe_st_count(const kt_moe *moe);
/* Lists them under `naming`, as views of the layer's memory; names: kt__moe_st_count *
 * KT__MOE_NAME_BYTES bytes for the names. */
kt_status kt__moe_st_items(const kt_moe *moe, const kt__moe_naming *naming, kt_st_item *items,
                           char *names);
/* kt_moe_load under `naming`, stored float dtypes converted to the layer's (as a session's
 * parameters are); dry_run checks what it would read (names, dtypes, shapes) and copies
 * nothing. */
kt_status kt__moe_load_named(kt_moe *moe, const kt_st_file *file, const kt__moe_naming *naming,
                             int dry_run);

/* ---- what a session's hooks (lib/ops/moe_state.c) do to a bound layer ---- */

/* Poisons the forward cache with the failure just recorded (a failed step). */
void kt__moe_session_poison(kt_moe *moe);
/* KT_OK, or the poisoned cache's failure (KT_ESTATE, naming the layer) for a `what`. */
kt_status kt__moe_session_check(const kt_moe *moe, const char *what);

/* The layer's owners: kt_moe_create makes one reference, each session bound to it adds one
 * (kt__moe_retain); kt_moe_destroy drops one and frees the layer with the last, so a session
 * drops its own through kt_moe_destroy. */
void kt__moe_retain(kt_moe *moe);
/* Drops one reference; returns 1 when it was the last (kt_moe_destroy then frees). */
int kt__moe_release(kt_moe *moe);

#endif
