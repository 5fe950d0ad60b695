/* The CPU Mixture-of-Experts layer.
 *
 * Tokens x [qlen, H] are routed to top-k experts: ids [qlen, k] (i32 or i64) with routing
 * weights w [qlen, k] (f32). Expert e is a SwiGLU MLP, down_e(silu(gate_e(x)) * up_e(x)),
 * gate/up [I, H] and down [H, I] (Hugging Face's nn.Linear layout), and
 *
 *     y = sum_j w[t, j] * expert_{ids[t, j]}(x[t]).
 *
 * The expert weights live in CPU memory (bf16 or f32) in a kt_moe object, which also holds
 * the buffers of the layer's forward and backward, sized once for a maximum token count, so
 * running the layer allocates nothing.
 *
 * Training modes: frozen (gradients for x and w only), LoRA (rank-r adapters A/B on each of
 * gate, up and down of every expert, with f32 gradients), full (f32 gradients of every expert
 * weight, accumulated across micro-batches: the first backward after kt_moe_zero_grad
 * overwrites, later ones add, each scaled by a caller-given factor such as 1/world).
 */
#ifndef KT_MOE_H
#define KT_MOE_H

#include <stddef.h>
#include <stdint.h>

#include "io.h"
#include "ops.h"
#include "runtime.h"
#include "status.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kt_moe kt_moe;

/* Layer indices a program's moe ops may name (the .ktg `layer`, kt_op_attrs.binding): 0 to
 * this - 1, so that a session's table of layers stays small. */
#define KT_MOE_MAX_LAYERS 4096

typedef enum kt_moe_mode { KT_MOE_FROZEN = 0, KT_MOE_LORA = 1, KT_MOE_FULL = 2 } kt_moe_mode;

/* Frozen expert weights stored quantized (kt_moe_config.quant): INT8 with one scale per output
 * channel, or INT4 with one scale per group of kt_moe_config.quant_group inputs (bf16 scales,
 * symmetric, rounded to nearest). docs/quantized.md has the formats and their error. */
typedef enum kt_moe_quant {
    KT_MOE_QUANT_NONE = 0,
    KT_MOE_QUANT_INT8 = 1,
    KT_MOE_QUANT_INT4 = 2
} kt_moe_quant;
/* "none", "int8", "int4"; NULL for an unknown value. */
const char *kt_moe_quant_name(kt_moe_quant quant);

#define KT_MOE_NUMA_SPLIT (-2)

/* Scratch buffers shared by several layers. A layer's buffers are of two kinds: what forward
 * keeps for backward (the routing, the input, the kept activations, the cached output), which
 * is the layer's own, and scratch that lives only during one call (the rows gathered per
 * expert, the activations and gradients between its GEMMs: kt_moe_get_memory's
 * scratch_bytes, about a hundred MB for a 2048-wide layer at 1024 tokens). The layers of a model run one at a time, so they can share one
 * scratch: it grows to the largest need of the layers created with it (allocated at the first call
 * after a layer raised it), and each call holds its lock, so layers sharing it never run at once.
 * Destroy it after the last of its layers. */
typedef struct kt_moe_scratch kt_moe_scratch;
/* numa_node: as kt_arena_create (-1: anywhere). On failure *scratch_out is NULL. */
kt_status kt_moe_scratch_create(int numa_node, kt_moe_scratch **scratch_out);
void kt_moe_scratch_destroy(kt_moe_scratch *scratch);
/* Bytes it holds now (0 before the first call). */
uint64_t kt_moe_scratch_bytes(const kt_moe_scratch *scratch);

typedef struct kt_moe_config {
    int64_t n_experts;     /* E */
    int64_t hidden;        /* H */
    int64_t intermediate;  /* I */
    int64_t top_k;         /* k: experts per token */
    int64_t max_tokens;    /* the largest qlen a call may bring (buffers are sized for it) */
    kt_dtype weight_dtype; /* KT_BF16 or KT_F32 */
    kt_dtype act_dtype;    /* x, y and their gradients: KT_F32 or KT_BF16 */
    kt_moe_mode mode;
    int64_t lora_rank; /* LoRA: r, 1 to min(H, I, 256) */
    float lora_alpha;  /* LoRA: the adapter output is scaled by alpha / r */
    /* 1: forward keeps the intermediate activations backward needs; 0: keep nothing and
     * recompute them inside backward (less memory: 2 k I floats a token; the gate and up
     * GEMMs run again). A compiled program says which its checkpointing wants for each moe
     * op (kt_program_moe_info's keep_activations). */
    int keep_activations;
    int check_finite; /* check the output for NaN/Inf and fail naming token and expert (the
                       * values as stored: after the per-token sum, and after rounding to bf16
                       * where the activations are bf16) */
    const char *name; /* the layer's name in messages (copied); may be NULL */
    /* >= 0: the expert weights (and every buffer) on this node; -1: no binding;
     * KT_MOE_NUMA_SPLIT: the experts split in contiguous ranges over the nodes of the pool's
     * threads (a pool from kt_threadpool_create_numa), each range's weights and full-mode
     * gradients on its node and its GEMMs run by that node's threads only. Results are
     * bitwise the same as without the split. */
    int numa_node;
    kt_moe_scratch *scratch; /* shared scratch (not owned); NULL: the layer has its own */
    /* How the layer's tensors are named in safetensors files when no prefix is given
     * (kt_moe_load and kt_moe_save with prefix NULL, kt_moe_save_layers with prefixes NULL):
     * kt_moe_tensor_name(names, layer, ...). kt_program_moe_config sets both from the moe op
     * (its `names` and `layer`). */
    kt_moe_names names;
    int layer; /* the model's layer index, 0 to KT_MOE_MAX_LAYERS - 1 */
    /* The model's expert index of each of the n_experts experts (copied; distinct, >= 0);
     * NULL: 0 to n_experts - 1. A rank's share of an expert-parallel layer (the moe op's
     * `parallel = ep`) holds some of the model's experts: checkpoint names and the LoRA init
     * follow these ids, so the shards' files together are the whole layer's. Views and
     * gradients (kt_moe_weight, ...) still take the layer's own index 0 to n_experts - 1. */
    const int64_t *expert_ids;
    /* Quantized frozen experts (KT_MOE_QUANT_NONE: the weights as weight_dtype). The weights are
     * quantized as they come in (kt_moe_set_weight and kt_moe_load take f32 or bf16) and the
     * layer multiplies by the dequantized values (bf16, f32 accumulation); weight_dtype must be
     * KT_BF16 (the dtype the activations meet the kernels in) and mode frozen or LoRA: a
     * quantized weight has no gradient. quant_group: INT4's inputs per scale, 32, 64 or 128
     * dividing both H and I (which must be multiples of 64); 0 means 64; ignored for INT8. */
    kt_moe_quant quant;
    int quant_group;
} kt_moe_config;

/* Creates the layer: validates the configuration, allocates the weight store (zeroed) and
 * all working buffers. pool: the MoE thread pool (not owned; NULL runs on the caller's
 * thread). Results are bitwise identical for any pool size. LoRA adapters start as PEFT's:
 * A uniform in +-1/sqrt(in) from a fixed seed (the same for every layer and run), B zero. */
kt_status kt_moe_create(const kt_moe_config *config, kt_threadpool *pool, kt_moe **moe_out);
/* Lifetime: the creator holds one reference and each session bound to the layer
 * (kt_session_options.moe_layers) another, so destroying the layer before its sessions is safe:
 * the last of kt_moe_destroy / kt_session_destroy frees it. Once destroyed, the creator must
 * not use it (sessions still may). The pool must outlive the layer. On failure *moe_out is
 * NULL. */
void kt_moe_destroy(kt_moe *moe);
/* The bytes a layer of this configuration holds that grow with its experts (the weights,
 * and the adapters or weight gradients it trains), plus optimizer_states f32 values per
 * trained value (what a session's optimizer keeps for them: 2 for AdamW, 0 to leave it out):
 * for checking a whole model against kt_memory_available before creating any layer.
 * kt_moe_create checks its own part. */
kt_status kt_moe_memory_need(const kt_moe_config *config, int optimizer_states,
                             uint64_t *bytes_out);
const kt_moe_config *kt_moe_get_config(const kt_moe *moe);

/* ---- weights ------------------------------------------------------------------------------ */

typedef enum kt_moe_proj { KT_MOE_GATE = 0, KT_MOE_UP = 1, KT_MOE_DOWN = 2 } kt_moe_proj;

/* Copies one expert's projection in: w is a contiguous CPU tensor of the weight dtype, gate/up
 * [I, H], down [H, I]; any other is KT_EINVAL saying what differs (dtype, shape, strides,
 * device). A quantized layer takes f32 or bf16 and quantizes it (a NaN or Inf weight is
 * KT_EINVAL naming it, the stored one left as it was). docs/moe.md walks through a layer's use;
 * examples/moe_layer.c is a whole program. */
kt_status kt_moe_set_weight(kt_moe *moe, int64_t expert, kt_moe_proj proj, const kt_tensor *w);
/* A view of the stored weight in its original layout (write through it to change it). A
 * quantized layer has no such view (KT_ESTATE): read it with kt_moe_get_weight. */
kt_status kt_moe_weight(kt_moe *moe, int64_t expert, kt_moe_proj proj, kt_tensor *view_out);
/* Copies the weight out into `out` (contiguous CPU, f32 or bf16, the projection's shape): the
 * values the layer multiplies by (a quantized layer's dequantized weights). */
kt_status kt_moe_get_weight(const kt_moe *moe, int64_t expert, kt_moe_proj proj, kt_tensor *out);
/* The checkpoint name of expert `expert`'s projection `proj` in model layer `layer` under the
 * scheme `names` (kt_moe_names, kt/ops.h), with `suffix` "weight" (the weight itself),
 * "lora_A.weight" (its LoRA A, [r, in]) or "lora_B.weight" (B, [out, r]):
 *
 *     KT_MOE_NAMES_MOE      moe.3.experts.5.up_proj.weight
 *     KT_MOE_NAMES_HF       model.layers.3.mlp.experts.5.up_proj.weight
 *     KT_MOE_NAMES_MIXTRAL  model.layers.3.block_sparse_moe.experts.5.w3.weight
 *                           (w1 gate, w3 up, w2 down)
 *
 * and "model.layers.3.mlp.experts.5.up_proj.lora_A.weight" for an adapter. Gradients are
 * "grad." + the name (kt-run). Writes at most size bytes, NUL-terminated; KT_ERANGE when the
 * name does not fit (buf untouched), KT_EINVAL for an unknown scheme, projection or suffix,
 * a negative layer or expert. */
kt_status kt_moe_tensor_name(kt_moe_names names, int layer, int64_t expert, kt_moe_proj proj,
                             const char *suffix, char *buf, size_t size);

/* Loads every expert from safetensors. prefix NULL: under the layer's own names
 * (kt_moe_config.names and .layer; kt_moe_tensor_name); otherwise Hugging Face's projection
 * names under the prefix: "<prefix>experts.<e>.gate_proj.weight", "...up_proj.weight",
 * "...down_proj.weight" (prefix "" allowed). Each tensor must have the weight dtype (a
 * session's kt_session_load and kt_moe_layers_load, kt/program.h, convert stored float dtypes
 * instead). In LoRA mode the adapters ("...lora_A.weight", "...lora_B.weight", f32) are
 * loaded too when the file has any of them: then it must have all of them. Every tensor is
 * checked (present, shape, dtype) before anything is copied: a bad file leaves the layer as
 * it was. */
kt_status kt_moe_load(kt_moe *moe, const kt_st_file *file, const char *prefix);
/* Writes the experts back out in the same naming (and the LoRA adapters, if any, as
 * "...lora_A.weight" / "...lora_B.weight"); prefix NULL: the layer's own names. A quantized
 * layer writes each weight as it holds it, exactly: "...weight.qcodes" (its value bytes as
 * i32, 1-D) and "...weight.qscales" (bf16 [out, groups]). kt_moe_load into a quantized layer
 * reads those (a NaN or Inf scale refused before anything is copied), or else float weights,
 * which it quantizes, or, from a file with neither (adapters alone), keeps its weights. */
kt_status kt_moe_save(const kt_moe *moe, const char *path, const char *prefix);
/* The same for n layers into one file, layer i under prefixes[i] (e.g. "moe.3.") or, where
 * prefixes is NULL or prefixes[i] is, under its own names; each reads back with kt_moe_load
 * and the same prefix. Two layers writing the same name are refused. */
kt_status kt_moe_save_layers(const kt_moe *const *layers, const char *const *prefixes, int n,
                             const char *path);

/* LoRA adapters: A [r, in] and B [out, r] of each projection (f32), with their gradients. */
kt_status kt_moe_lora(kt_moe *moe, int64_t expert, kt_moe_proj proj, int which_b,
                      kt_tensor *view_out);
kt_status kt_moe_lora_grad(kt_moe *moe, int64_t expert, kt_moe_proj proj, int which_b,
                           kt_tensor *view_out);
/* Full mode: the f32 gradient of one expert's projection (original layout). */
kt_status kt_moe_weight_grad(kt_moe *moe, int64_t expert, kt_moe_proj proj, kt_tensor *view_out);
/* The next backward overwrites the weight (or LoRA) gradients instead of adding. */
void kt_moe_zero_grad(kt_moe *moe);

/* ---- running --------------------------------------------------------------------------------- */

/* Blocking forward: y [qlen, H] (act dtype). */
kt_status kt_moe_forward(kt_moe *moe, const kt_tensor *x, const kt_tensor *ids,
                         const kt_tensor *weights, kt_tensor *y);
/* The same split in two: submit validates and returns at once while the experts run on the
 * MoE pool; sync waits and returns the result's status. x, ids, weights and y must stay
 * valid until sync. One forward or backward may be in flight at a time: a second submit, a
 * forward or a backward before sync fail with KT_ESTATE (and change nothing); sync without a
 * submit is KT_ESTATE too. Until sync, the caller must not change the layer (weights,
 * gradients, cache); work it submits to the MoE pool meanwhile is safe but waits for the
 * job's phases (one submission lock per pool), so keep other work on another pool. kt_moe_destroy
 * waits for a job in flight.
 *
 * Errors (each message names the layer, and the token/expert where one is at fault): wrong
 * dtypes or shapes KT_EINVAL; qlen > max_tokens KT_ERANGE; an expert id outside [0, E)
 * KT_ERANGE; an expert twice in one token KT_EINVAL; with check_finite, a NaN/Inf in the
 * output KT_ERANGE (y is left unchanged). A failed forward leaves the layer usable, but with
 * no forward for backward to use. */
kt_status kt_moe_submit_forward(kt_moe *moe, const kt_tensor *x, const kt_tensor *ids,
                                const kt_tensor *weights, kt_tensor *y);
kt_status kt_moe_sync(kt_moe *moe);

/* Backward of the last forward: grad_y -> grad_x [qlen, H], grad_weights [qlen, k] (f32),
 * and by mode the LoRA or expert-weight gradients (each scaled by weight_grad_scale, e.g.
 * 1/world for data-parallel averaging). grad_x or grad_weights may have data NULL to skip.
 * KT_ESTATE without a successful forward. It does not consume the forward: calling it again
 * recomputes the same gradients (and adds them to the weight gradients). With check_finite, a
 * NaN/Inf in grad_x or grad_weights is KT_ERANGE naming the token and the expert (grad_x and
 * grad_weights are left unchanged; the weight gradients of this call are not meaningful). */
kt_status kt_moe_backward(kt_moe *moe, const kt_tensor *grad_y, kt_tensor *grad_x,
                          kt_tensor *grad_weights, float weight_grad_scale);

/* ---- the forward cache (for checkpoint recompute) ------------------------------------------ */

typedef enum kt_moe_cache_state {
    KT_MOE_CACHE_EMPTY = 0,
    KT_MOE_CACHE_READY = 1,   /* holds the output of the first forward */
    KT_MOE_CACHE_POISONED = 2 /* a failure happened: errors until cleared */
} kt_moe_cache_state;

/* With the cache on, a forward stores its output; a recompute forward with the same inputs
 * returns the stored output instead of running the experts; backward clears it; any failure
 * poisons it, and a poisoned cache fails every forward until kt_moe_cache_clear.
 * "The same inputs" means the same qlen, ids and routing weights (bitwise); x is not compared
 * (a recompute brings the same x). A READY forward with other ids or weights is KT_ESTATE and
 * poisons the cache. A poisoned cache fails forward and backward with KT_ESTATE and the first
 * failure's message. Refusals of a call while a submitted forward is in flight do not poison.
 * Turning the cache off empties it. The stored output (f32 [max_tokens, H]) is allocated when
 * the cache is first turned on (KT_ENOMEM if it cannot be) and counted in workspace_bytes; a
 * layer that never uses the cache (nor check_finite, which stages the output there) holds
 * none. */
kt_status kt_moe_cache_enable(kt_moe *moe, int on);
kt_moe_cache_state kt_moe_cache_get_state(const kt_moe *moe);
void kt_moe_cache_clear(kt_moe *moe);

/* ---- accounting --------------------------------------------------------------------------------
 */

typedef struct kt_moe_memory {
    uint64_t weight_bytes;          /* expert weights as stored (quantized: values and scales) */
    uint64_t raw_weight_bytes;      /* E * 3 * H * I * dtype size (the weight dtype's) */
    uint64_t backward_buffer_bytes; /* transposed/repacked weights for backward, if any */
    uint64_t saved_bytes_per_token; /* kept from forward to backward, per token: the routing
                                     * (16 bytes per slot), x in the weight dtype, and with
                                     * keep_activations the f32 gate and up pre-activations
                                     * (k * 2I * 4 bytes), and in LoRA mode each projection's
                                     * x A^T (k * 3r * 4 bytes) */
    uint64_t workspace_bytes;       /* working buffers the layer holds itself (with the
                                     * forward cache's output once the cache is on) */
    uint64_t scratch_bytes;         /* the per-call scratch it needs: held by the layer, or
                                     * by its shared kt_moe_scratch (then not counted in
                                     * workspace_bytes) */
    uint64_t grad_bytes;            /* LoRA adapters and their gradients, full-mode weight
                                     * gradients (f32) */
} kt_moe_memory;

void kt_moe_get_memory(const kt_moe *moe, kt_moe_memory *memory_out);

/* Where a layer's time goes: the wall time of each phase of its forward and backward calls,
 * summed since creation or the last reset (kt-bench moe --phases prints it per call). */
typedef enum kt_moe_phase {
    KT_MOE_PHASE_ROUTE = 0,     /* forward: checks, routing, grouping tokens per expert */
    KT_MOE_PHASE_GATHER,        /* forward: x into the expert-sorted rows */
    KT_MOE_PHASE_GATE_UP,       /* forward: gate and up GEMMs, SiLU product */
    KT_MOE_PHASE_DOWN,          /* forward: down GEMM */
    KT_MOE_PHASE_COMBINE,       /* forward: weighted sum per token, output written */
    KT_MOE_PHASE_RECOMPUTE,     /* backward: what forward did not keep */
    KT_MOE_PHASE_ROUTING_GRAD,  /* backward: grad_y into each expert row (and weighted) */
    KT_MOE_PHASE_DOWN_GRAD,     /* backward: down's input gradient, SiLU derivative, routing-weight
                                   gradients */
    KT_MOE_PHASE_GATE_UP_GRAD,  /* backward: gate's and up's input gradients */
    KT_MOE_PHASE_WEIGHT_GRAD,   /* backward: LoRA or full-mode weight gradients */
    KT_MOE_PHASE_INPUT_COMBINE, /* backward: grad_x summed per token */
    KT_MOE_PHASE_COUNT
} kt_moe_phase;

typedef struct kt_moe_phase_times {
    uint64_t ns[KT_MOE_PHASE_COUNT];
    uint64_t forward_calls, backward_calls; /* those that ran the experts (not cache hits) */
} kt_moe_phase_times;

/* Read or reset while no call of the layer is in flight. */
void kt_moe_get_phase_times(const kt_moe *moe, kt_moe_phase_times *times_out);
void kt_moe_reset_phase_times(kt_moe *moe);
/* "route", "gather", ...; NULL for a value out of range */
const char *kt_moe_phase_name(int phase);

#ifdef __cplusplus
}
#endif
#endif
