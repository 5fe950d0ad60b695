/* The MoE layer's internals, shared by the files of lib/moe/.
 *
 * Rows. A call with qlen tokens and top-k has N = qlen * k (token, slot) pairs. Routing sorts
 * them by expert with a counting sort (token order within an expert), and every per-pair
 * buffer below is indexed by that sorted "row": expert e owns rows
 * [route.row_start[e], route.row_start[e + 1]), so each expert's rows are one contiguous
 * matrix that the GEMM kernels read directly.
 *
 * Work split. A phase of GEMMs is a list of tasks (expert, column block) over the active
 * experts, with block widths chosen so every task costs about the same (rows * columns), run
 * by kt_parallel_for's static partition. One token and many experts' columns, or many tokens
 * over a few experts, both give every thread work. Each output element is produced by one
 * task with a fixed summation order, so results do not depend on the thread count.
 *
 * Compute dtype. Activations fed to the GEMMs are stored in the weight dtype ("cdt": bf16 for
 * the bf16 kernels, f32 for kt__sgemm); every sum accumulates in f32.
 */
#ifndef KT_MOE_INTERNAL_H
#define KT_MOE_INTERNAL_H

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "kt/moe.h"
#include "lib/kernels/prefetch.h"
#include "lib/kernels/quant.h"

#define KT__MOE_NAME_MAX 64
#define KT__MOE_MSG_MAX 512
/* Column blocks are multiples of this (the kernels' natural tile width). */
#define KT__MOE_COL_ALIGN 16
#define KT__MOE_MAX_GROUPS 64 /* NUMA node groups (KT_NUMA_FAKE_NODES allows up to 64) */
/* LoRA ranks the adapter kernels take (lora.c keeps r pieces of a row on the stack) */
#define KT__MOE_LORA_MAX_RANK 256

/* Per-token rows are worked on in pieces of this many f32 values (16 KiB stack buffers). */
#define KT__MOE_ROW_CHUNK 4096

typedef struct kt__moe_task {
    int64_t e;
    int64_t c0, c1;
} kt__moe_task;

/* One thread's tasks of a phase still to run, [front, back) packed as front << 32 | back: the
 * thread takes them from the front, and the other threads of its node group take them from
 * the back once their own are done (kt__moe_run_parts). A cache line each. */
typedef struct kt__moe_queue {
    _Atomic uint64_t span;
    unsigned char pad[64 - sizeof(uint64_t)];
} kt__moe_queue;

/* The validated arguments of one forward. */
typedef struct kt__moe_job {
    const kt_tensor *x, *ids, *w;
    kt_tensor *y;
    kt_tensor xs, idss, ws, ys; /* copies, so a submitted job does not depend on the caller's
                                 * structs (only on their data) */
    int64_t qlen;
    int cache_hit;
} kt__moe_job;

/* The layer, by concern. Each part is held by value (no pointer to follow in the hot loops).
 *
 * Configuration: the validated copy of the caller's config, and the sizes derived from it;
 * constant after kt_moe_create. The one-letter sizes are the ones the comments use. */
typedef struct kt__moe_dims {
    int64_t E; /* experts */
    int64_t H; /* hidden (the model dimension) */
    int64_t I; /* intermediate (each expert's gate/up width) */
    int64_t K; /* top-k: slots per token */
    int64_t T; /* max_tokens */
    int64_t N; /* T * K: the most rows a call has */
    int64_t R; /* LoRA rank (0 outside LoRA mode) */
    /* row stride (elements) of the H-wide compute-dtype rows (x_rows, grad_y_rows,
     * grad_y_weighted): H, or a cache line more where H's bytes are a multiple of 1 KiB, since
     * the kernels read a dozen rows at once and rows 4 KiB apart all fall in one L1 set */
    int64_t ld_h;
    size_t cdt_bytes; /* bytes per compute-dtype element */
    int bf16;         /* weights (and the compute dtype) are bf16 */
    kt__qfmt quant;   /* the weights are quantized (bf16 is then the compute dtype) */
    /* the GEMMs run as blocks over the layer's pool through layer_gemm.c (bf16, and f32 where
     * kt__f32_gemm_tiled()); otherwise f32 calls kt__sgemm once per expert */
    int tiled;
    float lora_scale; /* alpha / r */
} kt__moe_dims;

/* The expert store: exactly the raw weights, no padding and no transposed copy (the backward
 * kernels read this layout). */
typedef struct kt__moe_experts {
    kt_arena arena;
    unsigned char *weights; /* [E][gate, up, down], each [I,H] / [I,H] / [H,I]; quantized:
                             * each its values and scales (quant_store.c) */
    kt__qmat *qmat;         /* quantized: [E][3] the matrices over those bytes; else NULL */
    unsigned char *q_work;  /* quantized: per thread q_work_bytes for the kernels (scratch) */
    size_t q_work_bytes;
} kt__moe_experts;

/* What a session's optimizer trains: LoRA adapters with their gradients, or full mode's weight
 * gradients (the weights themselves are the store). */
typedef struct kt__moe_trained {
    kt_arena arena;
    float *lora, *lora_grad; /* [E][3][A r*in | B out*r] */
    float *weight_grad;      /* [E][3][H*I] f32, full mode */
    int grad_overwrite;      /* the next backward overwrites the weight/LoRA gradients */
} kt__moe_trained;

/* Routing of the last forward (saved for backward), and the per-phase task plans. Rows are
 * the (token, slot) pairs sorted by expert (see the top of this file). */
typedef struct kt__moe_routing {
    int64_t qlen;
    int32_t *slot_expert; /* [N] by slot t*k+j */
    float *slot_weight;   /* [N] the routing weight of each slot */
    int32_t *slot_row;    /* [N] slot -> sorted row */
    int32_t *row_expert;  /* [N] sorted row -> expert */
    int64_t *row_start;   /* [E+1]: expert e owns rows [row_start[e], row_start[e + 1]) */
    int64_t *sort_cursor; /* [E] the counting sort's next row of each expert */
    kt__moe_task *tasks;
    int64_t max_tasks;
    int64_t *share;            /* [n_threads + 1]: thread p's tasks of kt__moe_plan_parts are
                                * [share[p], share[p + 1]) */
    kt__moe_queue *share_left; /* [n_threads]: what is left of each thread's share while they
                                * run */
} kt__moe_routing;

/* NUMA node groups (one group without KT_MOE_NUMA_SPLIT): group g's experts
 * [expert_start[g], expert_start[g + 1]) have their weights (and full-mode gradients) on node
 * node[g] and run on threads [thread_start[g], thread_start[g + 1]). */
typedef struct kt__moe_numa {
    int n_groups;
    int node[KT__MOE_MAX_GROUPS];
    int64_t expert_start[KT__MOE_MAX_GROUPS + 1];
    int64_t thread_start[KT__MOE_MAX_GROUPS + 1];
} kt__moe_numa;

/* The forward's buffers ("cdt": the compute dtype); "saved" ones survive to backward. */
typedef struct kt__moe_fwd_bufs {
    void *x_saved;     /* [T,H] cdt: the input, saved */
    void *x_rows;      /* [N,H] cdt: the input gathered into rows by expert */
    float *gate_pre;   /* [N,I] gate pre-activation g, saved when keep_activations */
    float *up_pre;     /* [N,I] up projection u, saved when keep_activations */
    void *act;         /* [N,I] cdt: silu(g) * u, the down projection's input */
    float *expert_out; /* [N,H] expert outputs (scratch: backward derives what it needs of them) */
    float *y_staged;   /* [T,H] the output staged in f32: with check_finite, or the forward
                        * cache's output (kt__moe_alloc_staged_y; NULL until first needed) */
    float *lora_xa[3]; /* [N,r] LoRA: x A^T per row, per projection */
    int valid;         /* routing and saved activations belong to a successful forward */
} kt__moe_fwd_bufs;

/* The backward's working buffers (gradients with respect to the forward's values). */
typedef struct kt__moe_bwd_bufs {
    void *grad_y_rows;     /* [N,H] cdt: grad_y of each row's token (the down input gradient's
                            * input) */
    void *grad_y_weighted; /* [N,H] cdt: w * grad_y per row (LoRA and full: their weight
                            * gradients' input) */
    float *grad_w_pieces;  /* [N, kt__moe_gw_pieces]: the routing gradient's sums per 16
                            * columns */
    float *row_weight;     /* [N] the routing weight of each row */
    float *grad_act;       /* [N,I], or per thread kt__moe_ga_floats each
                            * (kt__moe_ga_per_thread): gradient of act */
    /* full mode, tiled, experts of more than 512 rows possible: per thread, the weight
     * gradient kernel's work buffer (kt__moe_gemm_tn_work_bytes(m, T) each) */
    unsigned char *tn_work;
    void *grad_gate_pre;    /* [N,I] cdt: gradient of gate_pre */
    void *grad_up_pre;      /* [N,I] cdt: gradient of up_pre */
    float *grad_x_rows;     /* [N,H] input gradient per row */
    float *grad_w_slots;    /* [N] routing-weight gradient per slot */
    float *lora_grad_xa[3]; /* [N,r] LoRA: the gradient of lora_xa, per projection */
} kt__moe_bwd_bufs;

/* Where the buffers above live, and what they add up to (kt_moe_get_memory). */
typedef struct kt__moe_mem {
    kt_arena kept;        /* the routing and what forward keeps for backward */
    kt_arena staged_y;    /* fwd.y_staged (kt__moe_alloc_staged_y) */
    kt_arena own_scratch; /* the per-call scratch, without a shared kt_moe_scratch */
    /* the scratch buffers' places: pointer and offset from the scratch base, bound at create
     * (own scratch) or at each call (shared, whose base may move as it grows) */
    int n_scratch;
    void **scratch_ptr[32];
    size_t scratch_off[32];
    size_t scratch_need;
    uint64_t workspace_bytes, saved_bytes_per_token, grad_bytes;
} kt__moe_mem;

typedef struct kt__moe_timing {
    uint64_t flops; /* expert GEMM FLOPs run (tests: the cache skips them) */
    kt_moe_phase_times phases;
    uint64_t phase_mark; /* when the phase being timed began (ns, monotonic) */
} kt__moe_timing;

/* The forward cache for checkpoint recompute (cache.c). */
typedef struct kt__moe_fcache {
    int on;
    atomic_int state; /* kt_moe_cache_state */
    char poison_msg[KT__MOE_MSG_MAX];
} kt__moe_fcache;

/* submit/sync: a driver thread, started by the first submit (async.c). */
typedef struct kt__moe_driver {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    int started;
    int stop;
    int busy;    /* submitted and not yet synced (caller's thread only) */
    int pending; /* handed to the driver, not yet taken */
    int done;
    kt_status status;
    char msg[KT__MOE_MSG_MAX];
    kt__moe_job job;
} kt__moe_driver;

struct kt_moe {
    kt_moe_config cfg; /* validated at create; cfg.name points at name */
    char name[KT__MOE_NAME_MAX];
    kt__moe_dims dim;
    kt_threadpool *pool;
    int n_threads;

    kt__moe_experts store;
    kt__moe_trained train;
    kt__moe_routing route;
    kt__moe_numa numa;
    kt__moe_fwd_bufs fwd;
    kt__moe_bwd_bufs bwd;
    kt__moe_mem mem;
    kt__moe_timing timing;
    kt__moe_fcache cache;
    kt__moe_driver async;
    atomic_int extra_refs; /* owners beyond the creator: sessions (trainable.h) */
    int64_t *expert_ids;   /* cfg.expert_ids' copy (cfg points at it), or NULL */
};

/* The model's index of the layer's expert e (kt_moe_config.expert_ids). */
static inline int64_t kt__moe_global_id(const kt_moe *m, int64_t e)
{
    return m->expert_ids ? m->expert_ids[e] : e;
}

/* The routing gradient's pieces per row: one per 16 columns of I (backward.c). */
static inline int64_t kt__moe_gw_pieces(const kt_moe *m) { return (m->dim.I + 15) / 16; }

/* Whether an output value survives its store: finite, and for bf16 below the half-way point
 * between bf16's largest finite value and infinity, 0x1.ffp127 (from there it rounds to Inf:
 * the tie goes to the even bit pattern, which is infinity's). check_finite tests this. */
static inline int kt__moe_out_ok(float v, int bf16)
{
    return isfinite(v) && (!bf16 || fabsf(v) < 0x1.ffp127f);
}

/* phase.c: kt__moe_phase_start marks the start of a call's first phase; each
 * kt__moe_phase_end adds the time since the last mark to `phase` and marks again. */
void kt__moe_phase_start(kt_moe *m);
void kt__moe_phase_end(kt_moe *m, kt_moe_phase phase);

/* layer.c: the stored weight of (e, proj): its first element, or a quantized layer's kt__qmat */
void *kt__moe_weight_ptr(const kt_moe *m, int64_t e, int proj);
/* The node of the layer's own buffers (-1: anywhere). */
int kt__moe_buffer_node(const kt_moe *m);
/* m->fwd.y_staged, the f32 [T, H] output staged before it is written out, allocated at its first
 * use (with check_finite at create, else when the forward cache is first turned on) and counted in
 * workspace_bytes; a layer that never stages holds none. */
kt_status kt__moe_alloc_staged_y(kt_moe *m);
float *kt__moe_lora_ptr(const kt_moe *m, float *base, int64_t e, int proj, int which_b);
int64_t kt__moe_proj_in(const kt_moe *m, int proj);
int64_t kt__moe_proj_out(const kt_moe *m, int proj);
/* For tests: expert GEMM FLOPs run by this layer so far. */
uint64_t kt__moe_flops_run(const kt_moe *m);

/* quant_store.c */
kt__qfmt kt__moe_qfmt(const kt_moe_config *c);
int64_t kt__moe_quant_group(const kt_moe_config *c);
kt_status kt__moe_quant_check(const kt_moe_config *c, const char *name);
/* Bytes of one expert's three quantized projections in the store. */
size_t kt__moe_quant_expert_bytes(const kt_moe_config *c);
/* Points store.qmat (allocated here) into store.weights. */
kt_status kt__moe_quant_bind(kt_moe *m);

/* route.c */
kt_status kt__moe_check_forward(kt_moe *m, const kt_tensor *x, const kt_tensor *ids,
                                const kt_tensor *w, const kt_tensor *y, kt__moe_job *job);
kt_status kt__moe_check_backward(kt_moe *m, const kt_tensor *gy, const kt_tensor *gx,
                                 const kt_tensor *gw, float scale);
kt_status kt__moe_route(kt_moe *m, const kt__moe_job *job);
/* Fills m->route.tasks for a phase over `cols` output columns; returns the task count. */
int64_t kt__moe_plan(kt_moe *m, int64_t cols);
/* How kt__moe_plan_parts may cut the last quarter of a share into pieces: anywhere (a task's
 * columns are whole rows of what the kernel streams: a weight's rows for x W^T, dw's for the
 * weight gradients), or leaving experts of a few rows whole (a task's columns are a run of
 * every row of the weight: the input gradients' g W). */
enum { KT__MOE_CUT_ANY = 0, KT__MOE_CUT_KEEP_SMALL = 1 };
/* Fills m->route.tasks and m->route.share with one equal share of the phase per thread, the last
 * quarter of each share cut finer (as `cut` allows); returns the task count. kt__moe_run_parts runs
 * fn(ctx, i, i + 1, thread) for every task i: each thread its own share in order, then what
 * is left at the end of the others' (of its node group). */
int64_t kt__moe_plan_parts(kt_moe *m, int64_t cols, int cut);
void kt__moe_run_parts(kt_moe *m, kt_range_fn fn, void *ctx);
int64_t kt__moe_get_id(const kt_tensor *ids, int64_t i);

/* forward.c */
/* fwd.x_saved -> fwd.x_rows (rows by expert); load_x first converts the job's x into x_saved. */
void kt__moe_gather(kt_moe *m, const kt__moe_job *job, int load_x);
kt_status kt__moe_compute(kt_moe *m, int in_backward);
kt_status kt__moe_forward_exec(kt_moe *m, kt__moe_job *job);

/* The per-token sums read, for each token t and piece [h0, h0 + n) of its row, the piece of
 * each of its slots j in turn (rows of f32, H apart). Before reading (t, j)'s: the piece read
 * next (slot j + 1's, else the next piece's or the next token's first), fetched while this one
 * is summed. A row read after the other from memory waits for each new stream to be picked up
 * by the hardware prefetcher. */
static inline void kt__moe_prefetch_next_slot_row(const kt_moe *m, const float *rows, int64_t t,
                                                  int64_t j, int64_t h0, int64_t n)
{
    int64_t nt = t, nj = j + 1, nh = h0;
    if (nj == m->dim.K) {
        nj = 0;
        nh = h0 + n;
        if (nh >= m->dim.H)
            nh = 0, nt = t + 1;
    }
    if (nt >= m->route.qlen)
        return;
    const int64_t len = m->dim.H - nh < n ? m->dim.H - nh : n;
    kt__prefetch_range(rows + (int64_t)m->route.slot_row[nt * m->dim.K + nj] * m->dim.H + nh,
                       (size_t)len * sizeof(float), KT__PF_READ);
}

/* layer_gemm.c: one block of a product in the weight dtype (tiled layers; see bf16_gemm.h for
 * the operands), run by pool thread `thread` (a quantized layer's work buffer is per thread).
 * nn: y's columns [0, k1 - k0) are w's columns [k0, k1) (w is the weight's first element, or
 * its kt__qmat); nn2: y's columns [k0, k1), as bf16_gemm.h's. nt's `next` is ignored by a
 * quantized layer (pass NULL). */
void kt__moe_gemm_nt(const kt_moe *m, int thread, int64_t M, int64_t n0, int64_t n1, int64_t K,
                     const void *x, int64_t ldx, const void *w, int64_t ldw, const void *next,
                     float *y, int64_t ldy);
void kt__moe_gemm_nn(const kt_moe *m, int thread, int64_t M, int64_t N, int64_t k0, int64_t k1,
                     const void *g, int64_t ldg, const void *w, int64_t ldw, float *y, int64_t ldy);
void kt__moe_gemm_nn2(const kt_moe *m, int thread, int64_t M, int64_t N, int64_t k0, int64_t k1,
                      const void *g0, const void *w0, const void *g1, const void *w1, int64_t ldg,
                      int64_t ldw, float *y, int64_t ldy, int stream);
void kt__moe_gemm_tn(const kt_moe *m, int64_t M, int64_t n0, int64_t n1, int64_t K, const void *g,
                     int64_t ldg, const void *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                     int accumulate, void *work);
size_t kt__moe_gemm_tn_work_bytes(const kt_moe *m, int64_t M);

/* Element i of a buffer in the compute dtype (bf16 or f32, m->dim.cdt_bytes bytes each) */
static inline void *kt__moe_cdt_at(const kt_moe *m, const void *base, int64_t i)
{
    return (unsigned char *)base + (size_t)i * m->dim.cdt_bytes;
}

/* lora.c: each runs over the pool; see there */
void kt__moe_lora_z(kt_moe *m, int proj, const void *in_c, int64_t ld_in);
void kt__moe_lora_add(kt_moe *m, int proj, const kt__moe_task *t, float *out);
void kt__moe_lora_gz(kt_moe *m, int proj, const void *gout_c, int64_t ld_gout);
void kt__moe_lora_grads(kt_moe *m, int proj, const void *gout_c, int64_t ld_gout, const void *in_c,
                        int64_t ld_in, float scale);
void kt__moe_lora_gin_add(kt_moe *m, int proj, const kt__moe_task *t, int64_t r0, int64_t r1,
                          float *gin, int64_t ldg);
/* backward.c: whether each thread has its own ga block (else ga is [N,I]), and its floats */
int kt__moe_ga_per_thread(const kt_moe *m);
size_t kt__moe_ga_floats(const kt_moe *m);

/* scratch.c: around each forward/backward exec: takes a shared scratch's lock, grows it if
 * a layer needs more, and points the layer's scratch buffers into it (release undoes the
 * lock; both are no-ops for a layer with its own scratch). */
kt_status kt__moe_scratch_register(kt_moe_scratch *s, size_t need);
kt_status kt__moe_scratch_acquire(kt_moe *m);
void kt__moe_scratch_release(kt_moe *m);
/* Points the layer's scratch buffers at their offsets from base (a block of scratch_need). */
void kt__moe_bind_scratch(kt_moe *m, void *base);

/* tensor_check.c: whether t is a contiguous CPU tensor of dtype d1 (or d2) and the given
 * shape; when not, writes into why every way it differs ("its strides are [1,128], not the
 * contiguous [64,1]", "its dtype is bf16, not f32", the device, the shape) and returns 0.
 * kt__moe_tensor_wanted describes what fits ("f32[128,64]", "i32 or i64 [5,2]"). */
int kt__moe_tensor_fits(const kt_tensor *t, kt_dtype d1, kt_dtype d2, int ndim,
                        const int64_t *shape, char *why, size_t size);
char *kt__moe_tensor_wanted(kt_dtype d1, kt_dtype d2, int ndim, const int64_t *shape, char *buf,
                            size_t size);

/* cache.c */
void kt__moe_poison(kt_moe *m);
kt_status kt__moe_check_poison(const kt_moe *m, const char *what);

/* backward.c */
kt_status kt__moe_backward_exec(kt_moe *m, const kt_tensor *gy, kt_tensor *gxo, kt_tensor *gwo,
                                float scale);

#endif
