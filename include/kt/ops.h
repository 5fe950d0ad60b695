/* The op table: every op libkt can run, with its forward and backward kernel.
 *
 * Ops are what graph nodes execute, and they can be called directly on tensors. One list
 * (KT_OP_LIST) generates the enum and the names; each op family lives in one file under
 * lib/ops/ that defines the op's table entry (shape inference, kernels, what the backward
 * reads, in-place safety, FLOP cost, and its attributes: name, type, default, valid range).
 * Parsing (.ktg), checking, CSE, the program file (.ktp) and the op reference in docs/ktg.md
 * are all driven by that entry, so adding an op touches that list and one file (plus a field
 * in kt_op_attrs below for an attribute no field holds yet; its tests and docs/ktg.md's
 * generated table, as docs/internals.md lists).
 *
 * Conventions shared by every op:
 * - Inputs and outputs are contiguous CPU tensors. Shape inference rejects wrong ranks,
 *   shapes and dtypes with KT_EINVAL and a message naming the op and the argument.
 * - Floating-point ops accept f32, bf16 and f16 unless noted; arithmetic is done in f32
 *   (round-to-nearest-even on store), and all float operands of one op share one dtype
 *   (but matmul's mixed product and cast, which converts).
 * - Backward overwrites each requested input gradient (it does not accumulate); a gradient
 *   tensor with data == NULL is not wanted and is skipped. An output gradient with
 *   data == NULL is only allowed for outputs that carry no gradient (router indices).
 * - Kernels are deterministic for a fixed thread count; most are deterministic for any.
 *
 * The ops and their layouts (N = leading dims flattened, "...": any leading dims):
 *   matmul        a [...,M,K] (trans_a: [...,K,M]), b [...,K,N] (trans_b: [...,N,K]) -> [...,M,N];
 *                 the leading (batch) dims broadcast as numpy's do (b may be a plain [K,N]); also
 *                 mixed precision: an f32 a with a bf16 or f16 b -> f32, the product of a
 *                 with b widened exactly, f32 sums; a's gradient f32, b's summed in f32 and
 *                 rounded to b's dtype
 *   add, sub, mul a [...], b broadcast into a (numpy rules: each of b's dims, aligned from
 *                 the end, is 1 or a's; b has no more dims than a, leading 1s aside) -> a's shape
 *   scale         x -> alpha * x
 *   silu          x -> x * sigmoid(x)
 *   sigmoid       x -> 1 / (1 + exp(-x))
 *   clamp         x -> min(max(x, min), max); the gradient passes where min <= x <= max
 *   sum, mean     x -> x reduced over `dim` (negative: from the end), kept as size 1 when
 *                 keepdim; summed in index order in f32
 *   expand        x with size 1 at `dim` -> that dim repeated `size` times; backward sums
 *   swiglu        g, u (same shape) -> silu(g) * u
 *   rmsnorm       x [...,H], w [H] -> x / sqrt(mean(x^2) + eps) * w
 *   softmax       x [...,V] -> softmax over the last dim
 *   log_softmax   x [...,V] -> log-softmax over the last dim
 *   cross_entropy logits [N,V], targets [N] (i32/i64) -> scalar f32: mean over tokens whose
 *                 target != ignore_index of -log_softmax(logits)[target]; 0 if none count
 *   embedding     table [V,H], ids [...] (i32/i64) -> [..., H]; backward scatter-adds
 *   topk_router   logits [N,E] (f32) [, bias [E] (f32)] -> ids [N,k] (i32), weights [N,k]
 *                 (f32): scores softmax (default) or sigmoid over E; the chosen experts are
 *                 the k largest scores (+ bias, when given: the bias changes the choice only,
 *                 never the weights, and takes no gradient) in descending order (ties: lower
 *                 expert first). With n_group > 1 and topk_group < n_group the choice is
 *                 group-limited: E splits into n_group equal groups, each scored by its max
 *                 or its top-2 sum (group_score), and only the topk_group best groups
 *                 (ties: lower group first) are chosen from. Weights are the chosen scores,
 *                 renormalised to sum 1 when norm_topk (sigmoid: w / (sum + 1e-20)), times
 *                 routed_scaling_factor; differentiable in the weights (not the choice)
 *   load_balance_loss logits [R,E] (f32), ids [R,k] (i32/i64) -> scalar f32: the Switch /
 *                 Mixtral auxiliary loss E * sum_e f_e P_e, f_e = (choices of e) / R,
 *                 P_e = mean over rows of softmax(logits)_e; differentiable in the logits
 *                 through P. Concatenate the rows of all MoE layers first (as transformers)
 *   conv1d        x [T,Cin] or [B,T,Cin], w [Cout,K,Cin] (depthwise: [C,K]) -> [(B,)T',Cout]
 *                 causal: y[t] uses x[t-K+1..t]; same: x[t-K/2 .. t+(K-1-K/2)];
 *                 valid: no padding, T' = T-K+1 (the input already carries its halos)
 *   concat        n_in tensors equal but along `dim` -> joined along `dim`
 *   narrow        x -> x[start : start+length] along `dim`
 *   transpose     x -> x with dims dim0 and dim1 swapped (materialised)
 *                 (concat's, narrow's and transpose's dims may be negative: from the end)
 *   reshape       x -> same elements, shape (ndim, shape); one entry may be -1
 *   moe           x [T,H], ids [T,k] (i32/i64), weights [T,k] (f32) -> y [T,H]: the CPU
 *                 MoE layer (kt/moe.h) the session binds as layer `binding`; it keeps what
 *                 its backward needs itself. It runs only inside a session (direct calls
 *                 fail: there is no layer to run), and is on the checkpoint save-list.
 *                 With a communicator of several ranks, rank 0 owns the experts: every
 *                 rank's rows are gathered to it, computed there and scattered back.
 *   halo          x (sharded along `dim` over the context-parallel ranks) -> x with
 *                 halo_left frames of rank r-1 before it and halo_right frames of rank r+1
 *                 after it along `dim` (zeros at the ends of the sequence); backward sends
 *                 the halo gradients back and adds them in. Without a communicator (or with
 *                 one rank) the halos are zeros.
 *   rope          x [B,T,H,D] or [T,H,D], positions [B,T] or [T] (i32/i64; absent: 0..T-1)
 *                 -> x's shape: the first rotary_dim elements of each head turned pair by
 *                 pair, pair j by the angle position * inv_freq_j (inv_freq_j =
 *                 theta^(-2j/rotary_dim), scaled linearly or by YaRN), the rest passed
 *                 through. Pairs (j, j + rotary_dim/2) (rotate_half), or with interleaved
 *                 (2j, 2j+1), written back there or, with deinterleave, to (j, j +
 *                 rotary_dim/2). Positions outside 0..max_positions-1 are KT_EINVAL; a
 *                 session builds the cos/sin table once; backward turns the gradient back.
 *   attention     q [B,T,Hq,D], k [B,S,Hkv,D], v [B,S,Hkv,Dv] (Hq a multiple of Hkv: query
 *                 head h reads KV head h / (Hq/Hkv)), optional segments [B,S] (i32/i64)
 *                 -> o [B,T,Hq,Dv], lse [B,Hq,T] (f32): softmax(scale q.k^T) v over the
 *                 visible keys (query t sits at position S-T+t; causal, window and segment
 *                 ids restrict what it sees), lse the log-sum-exp of each row. A row that
 *                 sees no key gives o = 0, lse = 0 and no gradient. D, Dv <= 256.
 *   cp_attention  q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,Dv], optional segments [B,T]: causal
 *                 attention over a sequence of W*T positions sharded along time over the
 *                 session's W ranks (two chunks of T/2 each, chosen by `layout`; T even)
 *                 -> o [B,T,Hq,Dv], lse [B,Hq,T] as attention's for this rank's queries.
 *                 K and V are all-gathered; the backward reduce-scatters their gradients
 *                 to their owners. With one rank (or none) it is causal attention.
 *   cast          x -> x converted to `dtype` (f32, bf16 or f16; round to nearest even);
 *                 backward converts the gradient back to x's dtype. The same dtype copies
 *   shift_labels  labels [..., S] (i32/i64) -> the same shape and dtype: out[..., t] =
 *                 labels[..., t+1] for t < S-1, out[..., S-1] = ignore_index (the causal
 *                 language model's targets, as transformers shifts them); no gradient
 */
#ifndef KT_OPS_H
#define KT_OPS_H

#include "runtime.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KT_OP_LIST(X)                 \
    X(MATMUL, matmul)                 \
    X(ADD, add)                       \
    X(SUB, sub)                       \
    X(MUL, mul)                       \
    X(SCALE, scale)                   \
    X(SILU, silu)                     \
    X(SWIGLU, swiglu)                 \
    X(SIGMOID, sigmoid)               \
    X(CLAMP, clamp)                   \
    X(SUM, sum)                       \
    X(MEAN, mean)                     \
    X(EXPAND, expand)                 \
    X(RMSNORM, rmsnorm)               \
    X(SOFTMAX, softmax)               \
    X(LOG_SOFTMAX, log_softmax)       \
    X(CROSS_ENTROPY, cross_entropy)   \
    X(EMBEDDING, embedding)           \
    X(TOPK_ROUTER, topk_router)       \
    X(CONV1D, conv1d)                 \
    X(CONCAT, concat)                 \
    X(NARROW, narrow)                 \
    X(TRANSPOSE, transpose)           \
    X(RESHAPE, reshape)               \
    X(MOE, moe)                       \
    X(HALO, halo)                     \
    X(ROPE, rope)                     \
    X(LOAD_BALANCE_LOSS, load_balance_loss) \
    X(ATTENTION, attention)           \
    X(CAST, cast)                     \
    X(SHIFT_LABELS, shift_labels)     \
    X(CP_ATTENTION, cp_attention)

typedef enum kt_op {
#define KT__OP_ENUM(upper, lower) KT_OP_##upper,
    KT_OP_LIST(KT__OP_ENUM)
#undef KT__OP_ENUM
        KT_OP_COUNT
} kt_op;

#define KT_OP_MAX_IN 8
#define KT_OP_MAX_OUT 2

typedef enum kt_conv_mode {
    KT_CONV_CAUSAL = 0,
    KT_CONV_SAME = 1,
    KT_CONV_VALID = 2
} kt_conv_mode;

typedef enum kt_rope_scaling {
    KT_ROPE_SCALING_NONE = 0,
    KT_ROPE_SCALING_LINEAR = 1, /* positions / factor */
    KT_ROPE_SCALING_YARN = 2    /* YaRN: inv_freq blended by beta_fast/beta_slow, cos/sin scaled */
} kt_rope_scaling;

typedef enum kt_router_scoring {
    KT_ROUTER_SOFTMAX = 0, /* p = softmax(logits) over the experts (Mixtral, Qwen, DeepSeek-V2) */
    KT_ROUTER_SIGMOID = 1  /* s = sigmoid(logits) per expert (DeepSeek-V3) */
} kt_router_scoring;

typedef enum kt_router_group_score {
    KT_ROUTER_GROUP_MAX = 0,     /* a group's best score (DeepSeek-V2) */
    KT_ROUTER_GROUP_TOP2_SUM = 1 /* the sum of its two best scores (DeepSeek-V3) */
} kt_router_group_score;

/* How a moe op's layer names its tensors in checkpoints (kt_moe_tensor_name, kt/moe.h):
 * expert e's projections of model layer l. */
typedef enum kt_moe_names {
    KT_MOE_NAMES_MOE = 0,    /* moe.<l>.experts.<e>.<gate_proj|up_proj|down_proj>.weight */
    KT_MOE_NAMES_HF = 1,     /* model.layers.<l>.mlp.experts.<e>.<gate_proj|up_proj|down_proj>
                              * .weight (Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3) */
    KT_MOE_NAMES_MIXTRAL = 2 /* model.layers.<l>.block_sparse_moe.experts.<e>.<w1|w3|w2>.weight
                              * (w1 gate, w3 up, w2 down) */
} kt_moe_names;

/* Where a moe op's experts run when the session has several ranks (docs/parallel.md). */
typedef enum kt_moe_parallel {
    KT_MOE_PARALLEL_RANK0 = 0, /* rank 0 holds every expert and runs every rank's rows */
    KT_MOE_PARALLEL_EP = 1     /* expert parallelism: each rank holds a share of the experts
                                * (a layer of top_k 1) and runs the (token, slot) pairs routed
                                * to them; rows travel by all-to-all */
} kt_moe_parallel;
/* Who chooses it (kt_session_options.moe_parallel, kt_moe_layers_options.parallel): each moe
 * op's `parallel` (0, what zeroed options give), or one mode for every moe op. */
typedef enum kt_moe_parallel_choice {
    KT_MOE_PARALLEL_PROGRAM = 0,
    KT_MOE_PARALLEL_ALL_RANK0 = 1,
    KT_MOE_PARALLEL_ALL_EP = 2
} kt_moe_parallel_choice;
/* Which of the sequence's 2W chunks rank r of W holds (cp_attention, kt-train's sharding). */
typedef enum kt_cp_layout {
    KT_CP_BALANCED = 0,  /* chunks r and 2W-1-r: equal causal work on every rank */
    KT_CP_CONTIGUOUS = 1 /* chunks 2r and 2r+1: frames [rT, (r+1)T), as halo shards */
} kt_cp_layout;

typedef enum kt_halo_mode {
    KT_HALO_P2P = 0,      /* tag messages with the two neighbours */
    KT_HALO_ALLGATHER = 1 /* every rank joins the same all-gathers: deterministic pattern */
} kt_halo_mode;

/* Attributes of all ops in one plain struct; each op reads only its own fields, which its
 * table entry lists with their defaults and valid ranges (the table in docs/ktg.md).
 *
 * A zeroed struct is NOT a default (a zero ignore_index would silently drop class 0): start
 * from kt_op_defaults(op), which fills the op's defaults and stamps made_for, then set the
 * fields to change:
 *
 *     kt_op_attrs a = kt_op_defaults(KT_OP_MATMUL);
 *     a.trans_b = 1;
 *     kt_graph_op(g, "h", KT_OP_MATMUL, &a, in, 2, &h);
 *
 * Every function taking attributes accepts NULL (all defaults; an op with a required
 * attribute then fails naming it) or a struct made by kt_op_defaults for that op; for an op
 * with attributes, any other struct (zeroed, designated-initialised, made for another op) is
 * refused with KT_EINVAL. Required attributes (scale's alpha, topk_router's k, narrow's
 * dim/start/length, transpose's dims, reshape's shape, sum's, mean's and expand's dim,
 * expand's size) must be set after kt_op_defaults. */
typedef struct kt_op_attrs {
    unsigned made_for;          /* set by kt_op_defaults: the op this struct is for */
    int trans_a, trans_b;       /* matmul */
    float alpha;                /* scale */
    float eps;                  /* rmsnorm (default 1e-6) */
    int64_t ignore_index;       /* cross_entropy: targets equal to it do not count (-100);
                                 * shift_labels: the last position's target */
    int k;                      /* topk_router: experts per token */
    int norm_topk;              /* topk_router: renormalise the chosen weights */
    int depthwise;              /* conv1d */
    kt_conv_mode conv_mode;     /* conv1d */
    int dim;                    /* concat, narrow, halo, sum, mean, expand */
    int64_t start, length;      /* narrow */
    int dim0, dim1;             /* transpose */
    int ndim;                   /* reshape: entries of shape */
    int64_t shape[KT_MAX_DIMS]; /* reshape */
    int binding;                /* moe: which of the session's MoE layers (kt/moe.h) runs it */
    int64_t halo_left, halo_right; /* halo: frames from the previous / next rank */
    kt_halo_mode halo_mode;        /* halo */
    float rope_theta;              /* rope: the frequency base (10000) */
    int rope_rotary_dim;           /* rope: elements of each head that rotate; 0: all */
    int rope_interleaved;          /* rope: pairs (2j, 2j+1) instead of (j, j + rotary_dim/2) */
    int rope_deinterleave;         /* rope: interleaved pairs written as [evens | odds] */
    int64_t rope_max_positions;    /* rope: positions 0..max_positions-1 (the table's size) */
    kt_rope_scaling rope_scaling;  /* rope */
    float rope_factor;             /* rope: linear / yarn scaling factor */
    int64_t rope_original_max_positions; /* rope, yarn: the trained context */
    float rope_beta_fast, rope_beta_slow; /* rope, yarn: the blend's correction range */
    float rope_mscale, rope_mscale_all_dim; /* rope, yarn: the attention factor's parts */
    float rope_attention_factor;   /* rope: scales cos and sin; 0: derived */
    int rope_truncate;             /* rope, yarn: the correction range in whole dims */
    kt_router_scoring router_scoring;         /* topk_router: softmax or sigmoid scores */
    int router_n_group;                       /* topk_router: expert groups (1: none) */
    int router_topk_group;                    /* topk_router: groups kept (0: all) */
    kt_router_group_score router_group_score; /* topk_router: how a group is scored */
    float router_scaling;                     /* topk_router: routed_scaling_factor */
    int reduce_keepdim;            /* sum, mean: keep the reduced dim as size 1 */
    int64_t expand_size;           /* expand: the repeated dim's new size */
    float clamp_min, clamp_max;    /* clamp */
    float attn_scale;              /* attention: on q.k (0: 1/sqrt(D)) */
    int attn_causal;               /* attention: key j visible to query t only if j <= S-T+t */
    int64_t attn_window;           /* attention: and only if S-T+t - j < window (0: none) */
    float attn_softcap;            /* attention: scores softcap * tanh(s / softcap) (0: none) */
    int64_t moe_intermediate;      /* moe: the experts' intermediate size (0: the caller's) */
    kt_moe_names moe_names;        /* moe: how its layer's tensors are named in checkpoints */
    kt_moe_parallel moe_parallel;  /* moe: rank 0 holds the experts, or each rank its share */
    kt_dtype cast_dtype;           /* cast: the output's dtype (f32, bf16 or f16) */
    kt_cp_layout cp_layout;        /* cp_attention: the chunks each rank holds */
} kt_op_attrs;

/* op's attributes at their defaults, stamped for op (required ones are marked "not set" and
 * must be given). An invalid op gives a zeroed struct, which every op with attributes
 * refuses. */
kt_op_attrs kt_op_defaults(kt_op op);

/* How kernels run: the pool (NULL: the caller's thread only) and scratch memory of at least
 * kt_op_scratch_bytes() bytes (64-byte aligned). A NULL kt_exec means both are absent. */
typedef struct kt_exec {
    kt_threadpool *pool;
    void *scratch;
    size_t scratch_bytes;
} kt_exec;

const char *kt_op_name(kt_op op); /* "matmul"; "?" for an invalid op */
kt_status kt_op_from_name(const char *name, kt_op *op_out);
/* Input count the op accepts (concat: 1..KT_OP_MAX_IN) and the outputs it produces. */
kt_status kt_op_arity(kt_op op, int *min_in, int *max_in, int *n_out);

/* Checks inputs and attributes and fills out[0..n_out) with the output dtypes and shapes
 * (contiguous, data NULL). n_out must be the op's output count. */
kt_status kt_op_infer(kt_op op, const kt_op_attrs *attrs, const kt_tensor *in, int n_in,
                      kt_tensor *out, int n_out);

/* Scratch needed by the forward (backward = 0) or backward (backward = 1) kernel. */
size_t kt_op_scratch_bytes(kt_op op, const kt_op_attrs *attrs, const kt_tensor *in, int n_in,
                           int backward);

/* Floating-point operations of the forward pass (multiply-add = 2). */
double kt_op_flops(kt_op op, const kt_op_attrs *attrs, const kt_tensor *in, int n_in);

/* Runs the forward kernel. out[] must have the inferred dtypes and shapes and hold memory of
 * its own: an output overlapping an input is KT_EINVAL, except output 0 exactly over an input
 * the op computes in place from (as the graph's planner shares them). */
kt_status kt_op_forward(kt_op op, const kt_op_attrs *attrs, const kt_tensor *in, int n_in,
                        kt_tensor *out, int n_out, const kt_exec *exec);

/* Runs the backward kernel: given the forward's inputs and outputs and the gradients of the
 * outputs (grad_out[0..n_out)), writes the requested gradients of the inputs
 * (grad_in[0..n_in), each with its input's dtype and shape, data NULL to skip). An input
 * gradient overlapping what the kernel reads or another input gradient is KT_EINVAL, except
 * grad_in[i] exactly over grad_out[0] where the op computes output 0 in place over input i. */
kt_status kt_op_backward(kt_op op, const kt_op_attrs *attrs, const kt_tensor *in, int n_in,
                         const kt_tensor *out, int n_out, const kt_tensor *grad_out,
                         kt_tensor *grad_in, const kt_exec *exec);

#ifdef __cplusplus
}
#endif
#endif
