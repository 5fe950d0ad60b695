/* Compiling a graph into a program, and running programs in sessions.
 *
 * A program is the compiled form of a graph: forward steps, backward steps, the memory plan
 * (every activation, gradient and scratch buffer at an offset in one arena), and the tables
 * of inputs, parameters and outputs. It serialises to a .ktp file (versioned, little-endian,
 * checksummed) and loads from a file or a memory buffer.
 *
 * A session runs a program. It allocates all of its memory when it is created (activations,
 * parameters, gradients, optimizer state); forward, backward and the optimizer step then
 * allocate nothing.
 */
#ifndef KT_PROGRAM_H
#define KT_PROGRAM_H

#include <stddef.h>
#include <stdint.h>

#include "graph.h"
#include "moe.h"
#include "runtime.h"
#include "status.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kt_program kt_program;
typedef struct kt_session kt_session;

/* ---- compiling (the compiler half: graph -> program) -------------------------------------- */

typedef struct kt_compile_options {
    int training;    /* build the backward schedule (needs a loss); 0: forward only */
    int no_inplace;  /* never let an output share its input's buffer */
    int no_cse;      /* keep duplicate nodes */
    /* Activation checkpointing: 0 uses the graph's own policy (kt_graph_set_checkpoint_policy
     * or the .ktg `policy` line); 1 uses `checkpoint` below instead. */
    int override_checkpoint;
    kt_checkpoint_policy checkpoint;
    /* Recompute the ops the op table marks must-save (the router, the MoE layer) like any
     * other: off by default, because re-running the CPU experts costs far more than keeping
     * one [tokens x hidden] tensor per layer (the MoE forward cache). */
    int recompute_must_save;
} kt_compile_options;

/* options may be NULL (training = 1 when the graph has a loss). */
kt_status kt_compile(const kt_graph *g, const kt_compile_options *options,
                     kt_program **program_out);
/* Lifetime: the creator (kt_compile, kt_program_load*) holds one reference and each session
 * made from the program another, so kt_program_destroy before kt_session_destroy is safe (the
 * last frees it). The creator must not use a program it destroyed. Every create function here
 * leaves its output NULL on failure (SQLite's rule), so a handle is NULL or valid. */
void kt_program_destroy(kt_program *p);

/* ---- what a program holds --------------------------------------------------------------------- */

typedef struct kt_program_stats {
    int n_forward_steps, n_backward_steps;
    int n_inputs, n_params, n_outputs, n_buffers;
    uint64_t arena_bytes;        /* the activation arena: planned peak */
    uint64_t lower_bound_bytes;  /* max over steps of the bytes live at that step */
    uint64_t param_bytes, grad_bytes;
    double forward_flops, backward_flops;
    double recompute_flops;      /* forward steps re-run in the backward (checkpointing) */
    int n_recompute_steps;
} kt_program_stats;

void kt_program_get_stats(const kt_program *p, kt_program_stats *stats_out);

typedef enum kt_tensor_role {
    KT_ROLE_INPUT = 0,
    KT_ROLE_PARAM = 1,
    KT_ROLE_OUTPUT = 2,
    KT_ROLE_GRAD = 3 /* the gradient of a trainable parameter */
} kt_tensor_role;

/* Names and shapes of inputs, parameters and outputs (data NULL); i counts from 0. */
int kt_program_count(const kt_program *p, kt_tensor_role role);
kt_status kt_program_tensor_info(const kt_program *p, kt_tensor_role role, int i,
                                 const char **name_out, kt_tensor *meta_out);

/* The dimension of an input split over the context-parallel ranks (the .ktg `shard` line,
 * kt_graph_shard_input), or -1 when the input is not sharded: each rank then feeds its own
 * slice of that dimension. */
kt_status kt_program_shard_dim(const kt_program *p, const char *input, int *dim_out);

/* The CPU MoE layers a program runs, so that a trainer can create them (kt/moe.h) without
 * knowing the model: one entry per moe op, in schedule order. */
typedef struct kt_program_moe {
    const char *name;   /* the moe node's name (valid while the program lives) */
    int binding;        /* its index in kt_session_options.moe_layers (the .ktg `layer`) */
    int64_t tokens;     /* rows per call on one rank: x's first dimension */
    int64_t hidden;     /* H: x's second dimension */
    int64_t top_k;      /* k: the ids' second dimension */
    int64_t n_experts;  /* E: the width of the logits of the topk_router op that chose the
                         * ids; 0 when the ids come from elsewhere (an input, another op) */
    kt_dtype act_dtype; /* x's dtype, the layer's act_dtype */
    /* What the layer should keep for its backward (kt_moe_config.keep_activations): 0 when
     * the checkpoint pass put the op in a recomputed segment (the graph trades compute for
     * memory there, and the layer's gate/up intermediates, 2 k I floats a token, are most of
     * it), 1 otherwise. Advice for whoever creates the layer; either value computes the same
     * gradients. */
    int keep_activations;
    /* The op's `intermediate`: the experts' intermediate size the program is written for
     * (an imported model's moe_intermediate_size), or 0 when whoever creates the layer says
     * (kt-train --moe-inter). */
    int64_t intermediate;
    /* The op's `names`: how the layer's tensors are named in checkpoints (kt_moe_tensor_name
     * with layer = binding), in the session's file and in kt-run's gradients. */
    kt_moe_names names;
    kt_moe_parallel parallel; /* the op's `parallel`: rank 0's experts, or expert parallelism */
} kt_program_moe;

int kt_program_moe_count(const kt_program *p);
kt_status kt_program_moe_info(const kt_program *p, int i, kt_program_moe *info_out);
/* The layer configuration (kt/moe.h) for moe op `info`: n_experts, hidden, top_k, act_dtype
 * and keep_activations from the program, max_tokens = info->tokens * world (with several
 * ranks the layer on rank 0 runs every rank's rows; 1 for one rank), names and layer (=
 * binding) from the op, and what a program cannot know from the arguments: the weight dtype,
 * the mode and, in LoRA mode, the adapters' rank and alpha (lora_rank is 0 in the other
 * modes). The intermediate size is the program's when info->intermediate > 0 (`intermediate`
 * may then be 0 or the same value: a different one is KT_EINVAL saying both), else
 * `intermediate`. The rest is the plain default: name = info->name (kt_moe_create copies it),
 * numa_node -1, no shared scratch, check_finite 0; set those in *config_out afterwards.
 * Validating the sizes is kt_moe_create's (or kt_moe_memory_need's) job. KT_EINVAL when the
 * program does not say how many experts there are (ids that do not come from a topk_router
 * op), for an intermediate size < 1 or world < 1; *config_out is set only on success. */
kt_status kt_program_moe_config(const kt_program_moe *info, int64_t intermediate,
                                kt_dtype weight_dtype, kt_moe_mode mode, int64_t lora_rank,
                                float lora_alpha, int world, kt_moe_config *config_out);

/* Every CPU MoE layer a program's moe ops run, made in one call (kt-train and kt-run do this
 * before kt_session_create; the layers array is kt_session_options.moe_layers). */
typedef struct kt_moe_layers_options {
    kt_dtype weight_dtype; /* KT_F32 or KT_BF16 */
    /* Quantized frozen experts (kt_moe_config.quant and .quant_group; weight_dtype KT_BF16) */
    kt_moe_quant quant;
    int quant_group;
    kt_moe_mode mode;
    int64_t lora_rank;     /* LoRA mode: the adapters' r and alpha */
    float lora_alpha;
    /* The intermediate size of the moe ops whose program leaves it to the caller (their
     * `intermediate` is 0); an op's own size is used where it has one. 0: none given, and
     * such an op is KT_EINVAL naming it. */
    int64_t intermediate;
    /* Several ranks (world > 1): the layers are sized for world times a rank's rows, and only
     * rank 0 creates them (the moe op runs rank 0's; the other ranks get NULL slots). 0 and 0
     * mean one rank. */
    int world, rank;
    /* Several ranks: an op in expert parallelism (its `parallel = ep`, or this choice) gets a
     * layer on every rank holding the rank's share of the experts: a consecutive range of
     * E/W (the first E % W ranks one more), top_k 1, the model's expert ids
     * (kt_moe_config.expert_ids), sized for every rank's (token, slot) pairs. Give the
     * session the same choice (kt_session_options.moe_parallel). */
    kt_moe_parallel_choice parallel;
} kt_moe_layers_options;

typedef struct kt_moe_layers {
    struct kt_moe **layers; /* [n], indexed by the ops' binding (`layer`); NULL where no moe
                             * op runs (DeepSeek's dense first layers) and on ranks > 0 */
    int n;                  /* the largest binding + 1 (0 without moe ops) */
    int n_ops;              /* moe ops in the program */
    int n_recompute;        /* ops whose layer keeps no intermediates (keep_activations 0) */
    kt_moe_scratch *scratch; /* one per-call scratch the layers share (they run one at a time) */
} kt_moe_layers;

/* Creates a layer for each moe op (kt_program_moe_config with the options, named
 * "moe.<binding>" in messages, sharing one scratch), weights zero: set them (kt_moe_load,
 * kt_moe_layers_init, kt_moe_layers_load or a session's kt_session_load). Two ops of one
 * binding get one layer (kt_session_create then refuses the program). pool: the layers' pool
 * (not owned; must outlive them). On failure nothing is left allocated and *layers_out is
 * zeroed; the message names the moe node and its layer. */
kt_status kt_moe_layers_create(const kt_program *p, const kt_moe_layers_options *options,
                               kt_threadpool *pool, kt_moe_layers *layers_out);
/* Drops the creator's reference to each layer (a session bound to them keeps its own), then
 * the scratch, and zeroes *layers. NULL or a zeroed struct is a no-op. */
void kt_moe_layers_destroy(kt_moe_layers *layers);
/* What kt_moe_layers_create would make on this rank holds (kt_moe_memory_need summed, with
 * optimizer_states f32 values per trained value), to check against kt_memory_available
 * first. */
kt_status kt_moe_layers_memory_need(const kt_program *p, const kt_moe_layers_options *options,
                                    int optimizer_states, uint64_t *bytes_out);
/* Draws every expert weight from the seed alone: uniform in +-1/sqrt(in) (nn.Linear's
 * range), one stream per (layer, expert, projection), so the weights depend neither on the
 * order the layers are created in nor on the rank or world size. */
kt_status kt_moe_layers_init(const kt_moe_layers *layers, uint64_t seed);
/* Loads every layer from one safetensors file under its own names (the op's `names`): the
 * experts and, in LoRA mode, the adapters when the file has them (kt_moe_load's rules;
 * stored float dtypes are converted to the layer's). A tensor that is none of the layers'
 * (another model's experts, more layers, adapters outside LoRA mode) is an error naming the
 * file and the tensor, as is a missing or misshapen one; everything is checked before
 * anything is copied. */
kt_status kt_moe_layers_load(const kt_moe_layers *layers, const char *path);

/* The values an integer input may hold: [0, bound), bound the smallest limit set by the ops
 * that read the input directly (embedding ids: the table's rows; cross_entropy targets: the
 * classes, ignore_index aside; rope positions: max_positions), also through shift_labels and
 * reshape (labels shifted into cross_entropy's targets get the classes; the ignore_index
 * aside, as there). -1 when none of them sets one. A data loader checks its
 * token ids with it, so that a bad file is reported by its offset rather than by the op. */
kt_status kt_program_index_bound(const kt_program *p, const char *input, int64_t *bound_out);

/* How the program's context-parallel attention expects the sequence over the ranks: the
 * layout of its cp_attention ops (kt/ops.h), KT_CP_CONTIGUOUS when it has none (the halo's
 * shards). A data loader feeds every sharded input in this layout. KT_EINVAL naming two ops
 * whose layouts differ. */
kt_status kt_program_cp_layout(const kt_program *p, kt_cp_layout *layout_out);

/* A human-readable listing: steps, each buffer's offset and lifetime, the peak against the
 * lower bound, FLOPs. Writes at most size bytes (NUL-terminated); returns the length the
 * full text needs (like snprintf). */
size_t kt_program_describe(const kt_program *p, char *buf, size_t size);
/* The steps and buffers as a Graphviz digraph (`dot -Tsvg`): an edge from each buffer a step
 * reads and to each buffer it writes; forward steps lightblue, backward salmon, fills and
 * gradient accumulation grey. Same contract as kt_program_describe. */
size_t kt_program_dot(const kt_program *p, char *buf, size_t size);

/* ---- .ktp files (the runtime half) ------------------------------------------------------------ */

kt_status kt_program_serialized_size(const kt_program *p, size_t *bytes_out);
kt_status kt_program_serialize(const kt_program *p, void *buf, size_t size);
/* Writes through kt_out_open/kt_out_commit (kt/io.h): the path holds the whole new program or,
 * on any failure, what it held before; a path that is not a regular file is refused. */
kt_status kt_program_save(const kt_program *p, const char *path);
/* Loading validates everything: magic, version, sizes, checksum, every table entry. */
kt_status kt_program_load_memory(const void *data, size_t size, kt_program **program_out);
/* Opens the file with kt_in_open (kt/io.h): a regular file or an anonymous pipe; a named FIFO,
 * a device or a directory is refused without waiting. */
kt_status kt_program_load(const char *path, kt_program **program_out);

/* ---- sessions ------------------------------------------------------------------------------------ */

/* KT_OPTIM_NONE: kt_session_step averages the gradients (over micro-batches and ranks),
 * measures their norm and starts a new accumulation, but updates nothing (the explicit way to
 * step without training: an SGD or AdamW learning rate of 0 is refused). */
typedef enum kt_optimizer_kind {
    KT_OPTIM_SGD = 0,
    KT_OPTIM_ADAMW = 1,
    KT_OPTIM_NONE = 2
} kt_optimizer_kind;
/* Every schedule starts with warmup_steps of linear warm-up (kt_optimizer_config); then constant
 * keeps lr, linear falls in a straight line and cosine along half a cosine to min_lr at
 * total_steps. */
typedef enum kt_lr_schedule_kind {
    KT_LR_CONSTANT = 0,
    KT_LR_COSINE = 1,
    KT_LR_LINEAR = 2
} kt_lr_schedule_kind;

typedef struct kt_optimizer_config {
    kt_optimizer_kind kind;
    /* No default: kt_session_step refuses a learning rate of 0 for SGD and AdamW (KT_EINVAL),
     * since zeroed options would otherwise train nothing with every step returning KT_OK; a
     * step that only averages gradients is KT_OPTIM_NONE. A session that only runs forward
     * and backward (gradients, evaluation) needs none. */
    float lr;
    float momentum, dampening; /* SGD */
    int nesterov;              /* SGD */
    float beta1, beta2, eps;   /* AdamW (0 means 0.9, 0.999, 1e-8) */
    float weight_decay;
    float clip_norm;           /* clip gradients to this global L2 norm; 0: off */
    kt_lr_schedule_kind schedule;
    int64_t warmup_steps;              /* every schedule: 0 none */
    int64_t total_steps;               /* linear and cosine reach min_lr here */
    float min_lr;                      /* linear and cosine */
} kt_optimizer_config;

/* One timeline event, recorded when the session is given a trace buffer. */
typedef struct kt_trace_event {
    const char *name;     /* the node's name */
    const char *category; /* "forward", "backward", "optimizer", ... */
    uint64_t start_ns, end_ns;
    int32_t step;         /* index in the program's schedule; -1 for session-level events */
} kt_trace_event;

typedef struct kt_session_options {
    int threads;                   /* 0: KT_NUM_THREADS or the CPU count */
    kt_threadpool *pool;           /* use this pool instead of creating one (not owned) */
    kt_optimizer_config optimizer;
    int micro_batches;             /* gradient accumulation: backward calls per step (0 = 1) */
    kt_trace_event *trace;         /* optional: events are recorded here ... */
    size_t trace_capacity;         /* ... up to this many (further events are dropped) */
    uint64_t seed;                 /* for parameter initialisation */
    /* The CPU MoE layers (kt/moe.h) the program's moe ops run: op attrs.binding indexes this
     * array (copied by the session; kt_moe_layers_create makes it). Each layer serves one moe
     * node; slots no op uses may be NULL (the bindings are the model's layer indices, with
     * holes where a layer has no moe op). The session holds a reference to each layer (see
     * kt_session_create). */
    struct kt_moe *const *moe_layers;
    int n_moe_layers;
    /* Several ranks (kt/comm.h; not owned): halo ops trade with the neighbouring ranks, moe
     * ops run on rank 0's layers (only rank 0 binds them), and kt_session_step averages the
     * gradients and the loss over the ranks before the optimizer (context and data
     * parallelism: every rank holds the same parameters). NULL: one rank. */
    struct kt_comm *comm;
    /* Several ranks: where the moe ops' experts run (kt_moe_parallel): each op's `parallel`
     * (0), or one mode for all of them; the layers given must be made for it
     * (kt_moe_layers_options.parallel). */
    kt_moe_parallel_choice moe_parallel;
} kt_session_options;

/* Lifetime: the session holds a reference to p and to each of the options' MoE layers, and
 * copies the moe_layers array; the pool, the communicator and the trace buffer are borrowed
 * and must outlive it. On failure *session_out is NULL. */
kt_status kt_session_create(const kt_program *p, const kt_session_options *options,
                            kt_session **session_out);
void kt_session_destroy(kt_session *s);
/* The bytes kt_session_create commits for this program and these options (the arenas, the
 * optimizer state, and that of the bound MoE layers' trainable weights; not the layers
 * themselves: kt_moe_memory_need). kt_session_create checks it against kt_memory_available
 * before it allocates anything, and refuses a plan that does not fit with KT_ENOMEM. */
kt_status kt_session_memory_bytes(const kt_program *p, const kt_session_options *options,
                                  uint64_t *bytes_out);

/* A view of a session tensor by role and name: write inputs and parameters through it, read
 * outputs and gradients. Stays valid for the session's life. */
kt_status kt_session_tensor(kt_session *s, kt_tensor_role role, const char *name,
                            kt_tensor *view_out);

/* Runs the parameter initialisers (all but KT_INIT_LOADED); done once at creation too. */
kt_status kt_session_init_params(kt_session *s, uint64_t seed);

/* Runs the forward schedule. When a step fails (forward, backward or a recompute), the forward
 * caches of the bound MoE layers are poisoned so that no stale output is ever reused; the next
 * forward reports that, names the layer, and clears it, so the step after works again. */
kt_status kt_session_forward(kt_session *s);
/* Backward of the last forward. With micro_batches = n, the first backward after a step
 * overwrites the parameter gradients and the next n-1 add to them. */
kt_status kt_session_backward(kt_session *s);
/* Applies the optimizer (gradients averaged over the micro-batches, clipped if asked) and
 * starts a new accumulation. Refused (KT_EINVAL, nothing changed) when optimizer.lr is 0, unless the optimizer
 * is KT_OPTIM_NONE. */
kt_status kt_session_step(kt_session *s);

/* The loss of the last forward (NaN before the first); after kt_session_step with several
 * ranks, the mean over the ranks. */
float kt_session_loss(const kt_session *s);
/* Global L2 norm of the gradients before clipping, at the last step. */
float kt_session_grad_norm(const kt_session *s);
float kt_session_lr(const kt_session *s);
int64_t kt_session_step_count(const kt_session *s);
/* Events recorded so far (at most trace_capacity); kt_session_trace_reset starts over. */
size_t kt_session_trace_count(const kt_session *s);
void kt_session_trace_reset(kt_session *s);

/* The session as one safetensors file (kt/io.h), written whole or not at all (kt_st_save:
 * a crash or a full disk leaves the previous file). Parameters are saved under their names,
 * and the MoE layers bound to the session (kt_session_options.moe_layers) under their moe
 * op's `names` (kt_moe_tensor_name with the op's layer: "moe.<layer>.experts..." by default,
 * "model.layers.<layer>.mlp.experts..." for hf; metadata "kt.moe_layers" lists them).
 * with_optimizer adds the optimizer state ("optimizer.momentum.<name>", "optimizer.m.<name>",
 * "optimizer.v.<name>"; "optimizer.m.moe.<layer>" ... for a layer's trainable values, flat)
 * and the step count (metadata "kt.step"). */
kt_status kt_session_save(kt_session *s, const char *path, int with_optimizer);

#define KT_LOAD_ALLOW_MISSING 1u /* parameters absent from the file keep their values */
#define KT_LOAD_OPTIMIZER 2u     /* also load the optimizer state and step count */
#define KT_LOAD_ALLOW_UNUSED 4u  /* tensors the program has no parameter for are skipped */
/* In a program that marks the parameters a checkpoint must hold (init `loaded`, as kt-import
 * writes them), the others (LoRA adapters added to the base model) keep their initial values
 * when the file lacks them; every `loaded` one must still be there. In a program without
 * `loaded` parameters the flag changes nothing: each parameter is required. */
#define KT_LOAD_ALLOW_INITIALISED 8u

/* Loads every parameter from the file, checking each one's dtype and shape against the
 * program; a missing parameter is an error unless KT_LOAD_ALLOW_MISSING, and a tensor that
 * is neither a parameter, a MoE layer's, nor an optimizer state of one is an error unless
 * KT_LOAD_ALLOW_UNUSED (as PyTorch's strict load_state_dict). When the file holds MoE
 * experts (the metadata, or a tensor under a moe op's names: a Hugging Face checkpoint), it
 * must hold every bound layer's, whole, under the op's names (stored float dtypes are
 * converted to the layer's weight dtype); LoRA adapters load when present (all or none). Everything is checked before anything is
 * copied: when any check fails, nothing is changed. */
kt_status kt_session_load(kt_session *s, const char *path, unsigned flags);

/* Writes events as Chrome trace-event JSON (chrome://tracing, Perfetto), whole or not at all
 * (kt_out_open, kt/io.h). */
kt_status kt_trace_write_json(const kt_trace_event *events, size_t n, const char *path);

#ifdef __cplusplus
}
#endif
#endif
