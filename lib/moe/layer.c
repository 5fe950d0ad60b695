/* The MoE layer object: configuration checks, the weight store and every working buffer,
 * all sized at creation so that running the layer allocates nothing. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/core/memory.h"
#include "lib/core/mix.h"
#include "lib/core/numa_internal.h"
#include "lib/kernels/bf16_gemm.h"
#include "lib/kernels/f32_gemm.h"
#include "lib/kernels/quant_gemm.h"
#include "lib/moe/moe_internal.h"
#include "lib/moe/trainable.h"

#define ALIGN 64

/* LoRA A is drawn from U(-1/sqrt(in), 1/sqrt(in)) (the bound PEFT's kaiming_uniform(a=sqrt(5))
 * gives), B is zero so the adapter starts as a no-op. Each value comes from splitmix64 of this
 * seed and its (expert, projection, index), so the init does not depend on creation order. */
#define LORA_SEED 0x6b742d6d6f652d41ull

int64_t kt__moe_proj_in(const kt_moe *m, int proj)
{
    return proj == KT_MOE_DOWN ? m->dim.I : m->dim.H;
}
int64_t kt__moe_proj_out(const kt_moe *m, int proj)
{
    return proj == KT_MOE_DOWN ? m->dim.H : m->dim.I;
}

void *kt__moe_weight_ptr(const kt_moe *m, int64_t e, int proj)
{
    if (m->dim.quant)
        return &m->store.qmat[e * 3 + proj];
    return m->store.weights + (size_t)((e * 3 + proj) * m->dim.H * m->dim.I) * m->dim.cdt_bytes;
}

float *kt__moe_lora_ptr(const kt_moe *m, float *base, int64_t e, int proj, int which_b)
{
    float *a = base + (e * 3 + proj) * m->dim.R * (m->dim.H + m->dim.I);
    return which_b ? a + m->dim.R * kt__moe_proj_in(m, proj) : a;
}

uint64_t kt__moe_flops_run(const kt_moe *m) { return m->timing.flops; }

const kt_moe_config *kt_moe_get_config(const kt_moe *moe) { return moe ? &moe->cfg : NULL; }

static kt_status check_config(const kt_moe_config *c)
{
    const char *name = c->name ? c->name : "moe";
    if (c->n_experts < 1 || c->hidden < 1 || c->intermediate < 1 || c->top_k < 1 ||
        c->max_tokens < 1)
        return kt__error(KT_EINVAL,
                         "moe '%s': n_experts, hidden, intermediate, top_k and max_tokens must "
                         "be >= 1 (got %lld, %lld, %lld, %lld, %lld)",
                         name, (long long)c->n_experts, (long long)c->hidden,
                         (long long)c->intermediate, (long long)c->top_k, (long long)c->max_tokens);
    for (int64_t e = 0; c->expert_ids != NULL && e < c->n_experts && e < INT32_MAX / 2; e++) {
        if (c->expert_ids[e] < 0)
            return kt__error(KT_EINVAL, "moe '%s': expert_ids[%lld] is %lld (negative)", name,
                             (long long)e, (long long)c->expert_ids[e]);
        for (int64_t o = 0; o < e; o++)
            if (c->expert_ids[o] == c->expert_ids[e])
                return kt__error(KT_EINVAL, "moe '%s': expert_ids[%lld] and [%lld] are both %lld",
                                 name, (long long)o, (long long)e, (long long)c->expert_ids[e]);
    }
    if (c->top_k > c->n_experts)
        return kt__error(KT_EINVAL, "moe '%s': top_k %lld exceeds n_experts %lld", name,
                         (long long)c->top_k, (long long)c->n_experts);
    /* Rows and tasks are indexed with int32 in places; keep every count well inside it, and
     * every byte count (the weights and their f32 gradients: E * 3 * H * I * 4) inside int64,
     * checked without overflowing (a wrapped product would size the buffers too small). */
    int64_t rows = 0, weight_bytes = 0;
    if (__builtin_mul_overflow(c->max_tokens, c->top_k, &rows) || rows > INT32_MAX / 2)
        return kt__error(KT_EINVAL, "moe '%s': max_tokens * top_k (%lld * %lld) exceeds %d rows",
                         name, (long long)c->max_tokens, (long long)c->top_k, INT32_MAX / 2);
    if (c->n_experts > INT32_MAX / 2 || c->hidden > (1 << 24) || c->intermediate > (1 << 24))
        return kt__error(KT_EINVAL,
                         "moe '%s': sizes too large (n_experts %lld, hidden %lld, intermediate "
                         "%lld; at most %d, %d, %d)",
                         name, (long long)c->n_experts, (long long)c->hidden,
                         (long long)c->intermediate, INT32_MAX / 2, 1 << 24, 1 << 24);
    if (__builtin_mul_overflow(c->n_experts * 3 * 4, c->hidden * c->intermediate, &weight_bytes))
        return kt__error(KT_EINVAL,
                         "moe '%s': %lld experts of hidden %lld x intermediate %lld: their "
                         "weights' byte count overflows int64",
                         name, (long long)c->n_experts, (long long)c->hidden,
                         (long long)c->intermediate);
    if (c->weight_dtype != KT_BF16 && c->weight_dtype != KT_F32)
        return kt__error(KT_EINVAL, "moe '%s': weight_dtype must be bf16 or f32, got %s", name,
                         kt_dtype_name(c->weight_dtype));
    if (c->act_dtype != KT_BF16 && c->act_dtype != KT_F32)
        return kt__error(KT_EINVAL, "moe '%s': act_dtype must be bf16 or f32, got %s", name,
                         kt_dtype_name(c->act_dtype));
    if (c->mode != KT_MOE_FROZEN && c->mode != KT_MOE_LORA && c->mode != KT_MOE_FULL)
        return kt__error(KT_EINVAL, "moe '%s': unknown mode %d", name, (int)c->mode);
    if (c->mode == KT_MOE_LORA) {
        if (c->lora_rank < 1 || c->lora_rank > c->hidden || c->lora_rank > c->intermediate ||
            c->lora_rank > KT__MOE_LORA_MAX_RANK)
            return kt__error(KT_EINVAL, "moe '%s': lora_rank %lld must be in [1, min(H, I, %d)]",
                             name, (long long)c->lora_rank, KT__MOE_LORA_MAX_RANK);
        if (!isfinite(c->lora_alpha))
            return kt__error(KT_EINVAL, "moe '%s': lora_alpha is not finite", name);
    }
    if (c->keep_activations != 0 && c->keep_activations != 1)
        return kt__error(KT_EINVAL, "moe '%s': keep_activations must be 0 or 1", name);
    if (c->numa_node < KT_MOE_NUMA_SPLIT)
        return kt__error(KT_EINVAL, "moe '%s': numa_node %d is invalid", name, c->numa_node);
    if ((int)c->names < KT_MOE_NAMES_MOE || (int)c->names > KT_MOE_NAMES_MIXTRAL)
        return kt__error(KT_EINVAL, "moe '%s': unknown tensor names %d (kt_moe_names)", name,
                         (int)c->names);
    if (c->layer < 0 || c->layer >= KT_MOE_MAX_LAYERS)
        return kt__error(KT_EINVAL, "moe '%s': layer %d is outside 0 to %d", name, c->layer,
                         KT_MOE_MAX_LAYERS - 1);
    return kt__moe_quant_check(c, name);
}

/* Node groups from the pool's thread placement (contiguous blocks of threads per node), the
 * experts cut into as many contiguous ranges; one group of everything without the split. */
static kt_status plan_groups(kt_moe *m, kt_threadpool *pool)
{
    m->numa.n_groups = 1;
    m->numa.node[0] = m->cfg.numa_node;
    m->numa.expert_start[0] = 0, m->numa.expert_start[1] = m->dim.E;
    m->numa.thread_start[0] = 0, m->numa.thread_start[1] = m->n_threads;
    if (m->cfg.numa_node != KT_MOE_NUMA_SPLIT)
        return KT_OK;
    if (kt_threadpool_thread_node(pool, 0) < 0)
        return kt__error(KT_EINVAL,
                         "moe '%s': KT_MOE_NUMA_SPLIT needs a pool from "
                         "kt_threadpool_create_numa",
                         m->name);
    int g = 0;
    m->numa.node[0] = kt_threadpool_thread_node(pool, 0);
    for (int t = 1; t < m->n_threads; t++) {
        int node = kt_threadpool_thread_node(pool, t);
        if (node == m->numa.node[g])
            continue;
        if (++g >= KT__MOE_MAX_GROUPS)
            return kt__error(KT_EINVAL, "moe '%s': more than %d NUMA nodes", m->name,
                             KT__MOE_MAX_GROUPS);
        m->numa.node[g] = node;
        m->numa.thread_start[g] = t;
    }
    m->numa.n_groups = g + 1;
    m->numa.thread_start[m->numa.n_groups] = m->n_threads;
    for (int i = 0; i <= m->numa.n_groups; i++)
        m->numa.expert_start[i] = m->dim.E * i / m->numa.n_groups;
    return KT_OK;
}

/* Each group's rows of a per-expert array (bytes_per_expert each) onto its node. */
static kt_status bind_groups(const kt_moe *m, void *base, size_t bytes_per_expert)
{
    for (int g = 0; m->cfg.numa_node == KT_MOE_NUMA_SPLIT && g < m->numa.n_groups; g++)
        KT__TRY(kt__numa_bind_range(
            (unsigned char *)base + (size_t)m->numa.expert_start[g] * bytes_per_expert,
            (size_t)(m->numa.expert_start[g + 1] - m->numa.expert_start[g]) * bytes_per_expert,
            m->numa.node[g]));
    return KT_OK;
}

/* The node of the layer's own buffers: none with the split (every node's threads use them). */
int kt__moe_buffer_node(const kt_moe *m)
{
    return m->cfg.numa_node == KT_MOE_NUMA_SPLIT ? -1 : m->cfg.numa_node;
}

typedef struct buf_spec {
    void **ptr;
    size_t bytes;
} buf_spec;

static size_t round_up(size_t v) { return (v + ALIGN - 1) / ALIGN * ALIGN; }

/* Carves every spec out of one arena; returns its size through total_out first when
 * arena is NULL. */
static kt_status carve(kt_arena *arena, const buf_spec *specs, int n, int numa_node,
                       size_t *total_out)
{
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += round_up(specs[i].bytes);
    *total_out = total;
    KT__TRY(kt_arena_create(arena, total ? total : ALIGN, numa_node));
    for (int i = 0; i < n; i++)
        KT__TRY(kt_arena_alloc(arena, round_up(specs[i].bytes), ALIGN, specs[i].ptr));
    return KT_OK;
}

/* Places a layer's per-call scratch buffers at offsets of one block (its own arena, or the
 * shared scratch); returns the block's size. */
static size_t plan_scratch(kt_moe *m)
{
    size_t N = (size_t)m->dim.N, H = (size_t)m->dim.H, I = (size_t)m->dim.I, cs = m->dim.cdt_bytes,
           R = (size_t)m->dim.R;
    size_t total = 0;
    m->mem.n_scratch = 0;
#define SCRATCH(p, b)                                                                              \
    (m->mem.scratch_ptr[m->mem.n_scratch] = (void **)&(p),                                         \
     m->mem.scratch_off[m->mem.n_scratch++] = total, total += round_up(b))
/* p at the offset of the buffer placed at slot s: their lives in a call never overlap */
#define SCRATCH_OVER(p, s)                                                                         \
    (m->mem.scratch_ptr[m->mem.n_scratch] = (void **)&(p),                                         \
     m->mem.scratch_off[m->mem.n_scratch++] = m->mem.scratch_off[s])
    SCRATCH(m->route.sort_cursor, (size_t)m->dim.E * 8);
    SCRATCH(m->route.tasks, (size_t)m->route.max_tasks * sizeof(kt__moe_task));
    SCRATCH(m->route.share, ((size_t)m->n_threads + 1) * 8);
    SCRATCH(m->route.share_left, (size_t)m->n_threads * sizeof(kt__moe_queue));
    const size_t ld_h = (size_t)m->dim.ld_h;
    /* Backward's input gradients grad_x_rows (f32 [N, H]) and forward's expert_out (the same
     * size) lie over two [N, ld_h] buffers that are dead whenever they live: in LoRA and full
     * mode grad_y_rows and grad_y_weighted (grad_y's per-slot copies, unused in forward, and
     * backward is done with them before it writes grad_x_rows); in frozen mode x_rows and
     * grad_y_rows (forward is done with the gathered rows before the down GEMM writes
     * expert_out; backward reads them only in its recompute, first). expert_out lives only in
     * forward: combine reads it, and backward takes the routing gradient without it. */
    const int frozen = m->cfg.mode == KT_MOE_FROZEN;
    SCRATCH(m->fwd.act, N * I * cs);
    const int xc_slot = m->mem.n_scratch;
    SCRATCH(m->fwd.x_rows, N * ld_h * cs);
    const int gyc_slot = m->mem.n_scratch;
    SCRATCH(m->bwd.grad_y_rows, N * ld_h * cs);
    if (!frozen)
        SCRATCH(m->bwd.grad_y_weighted, N * ld_h * cs);
    /* the pair ends here; should grad_x_rows ever outgrow it, it would run on into space kept
     * for it (with ld_h >= H the pair holds 4 N ld_h >= N H 4 bytes in either dtype) */
    const int over_slot = frozen ? xc_slot : gyc_slot;
    if (m->mem.scratch_off[over_slot] + round_up(N * H * 4) > total)
        total = m->mem.scratch_off[over_slot] + round_up(N * H * 4);
    SCRATCH_OVER(m->bwd.grad_x_rows, over_slot);
    SCRATCH_OVER(m->fwd.expert_out, over_slot);
    SCRATCH(m->bwd.grad_w_pieces, N * (size_t)kt__moe_gw_pieces(m) * 4);
    SCRATCH(m->bwd.row_weight, N * 4);
    SCRATCH(m->bwd.grad_act,
            kt__moe_ga_per_thread(m) ? (size_t)m->n_threads * kt__moe_ga_floats(m) * 4 : N * I * 4);
    if (m->dim.tiled && m->cfg.mode == KT_MOE_FULL && kt__moe_gemm_tn_work_bytes(m, m->dim.T) > 0)
        SCRATCH(m->bwd.tn_work, (size_t)m->n_threads * kt__moe_gemm_tn_work_bytes(m, m->dim.T));
    SCRATCH(m->bwd.grad_gate_pre, N * I * cs);
    SCRATCH(m->bwd.grad_up_pre, N * I * cs);
    SCRATCH(m->bwd.grad_w_slots, N * 4);
    if (m->dim.quant)
        SCRATCH(m->store.q_work, (size_t)m->n_threads * m->store.q_work_bytes);
    if (!m->cfg.keep_activations) { /* recomputed in backward: nothing to keep */
        SCRATCH(m->fwd.gate_pre, N * I * 4);
        SCRATCH(m->fwd.up_pre, N * I * 4);
    }
    if (m->cfg.mode == KT_MOE_LORA)
        for (int p = 0; p < 3; p++) {
            if (!m->cfg.keep_activations)
                SCRATCH(m->fwd.lora_xa[p], N * R * 4);
            SCRATCH(m->bwd.lora_grad_xa[p], N * R * 4);
        }
#undef SCRATCH
#undef SCRATCH_OVER
    return total ? total : ALIGN;
}

kt_status kt__moe_alloc_staged_y(kt_moe *m)
{
    if (m->fwd.y_staged != NULL)
        return KT_OK;
    const size_t bytes = round_up((size_t)(m->dim.T * m->dim.H) * sizeof(float));
    KT__TRY(kt_arena_create(&m->mem.staged_y, bytes, kt__moe_buffer_node(m)));
    m->fwd.y_staged = (float *)(void *)m->mem.staged_y.base;
    m->mem.workspace_bytes += bytes;
    return KT_OK;
}

static kt_status alloc_work(kt_moe *m)
{
    size_t N = (size_t)m->dim.N, T = (size_t)m->dim.T, H = (size_t)m->dim.H, I = (size_t)m->dim.I;
    size_t cs = m->dim.cdt_bytes;
    size_t R = (size_t)m->dim.R;
    buf_spec s[16];
    int n = 0;
#define SPEC(p, b) (s[n].ptr = (void **)&(p), s[n].bytes = (b), n++)
    SPEC(m->route.slot_expert, N * 4);
    SPEC(m->route.slot_weight, N * 4);
    SPEC(m->route.slot_row, N * 4);
    SPEC(m->route.row_expert, N * 4);
    SPEC(m->route.row_start, ((size_t)m->dim.E + 1) * 8);
    SPEC(m->fwd.x_saved, T * H * cs);
    if (m->cfg.keep_activations) {
        SPEC(m->fwd.gate_pre, N * I * 4);
        SPEC(m->fwd.up_pre, N * I * 4);
        if (m->cfg.mode == KT_MOE_LORA)
            for (int p = 0; p < 3; p++)
                SPEC(m->fwd.lora_xa[p], N * R * 4);
    }
#undef SPEC
    size_t total = 0;
    KT__TRY(carve(&m->mem.kept, s, n, kt__moe_buffer_node(m), &total));
    m->mem.scratch_need = plan_scratch(m);
    if (m->cfg.scratch != NULL) {
        KT__TRY(kt__moe_scratch_register(m->cfg.scratch, m->mem.scratch_need));
    } else {
        KT__TRY(kt_arena_create(&m->mem.own_scratch, m->mem.scratch_need, kt__moe_buffer_node(m)));
        kt__moe_bind_scratch(m, m->mem.own_scratch.base);
        total += m->mem.scratch_need;
    }
    m->mem.workspace_bytes = total;
    if (m->cfg.check_finite) /* the output is staged (forward.c) */
        KT__TRY(kt__moe_alloc_staged_y(m));
    /* Kept from forward to backward, the work buffers but the per-call expert offsets: the
     * routing (4 x 4 bytes per slot), the input in the compute dtype, and with
     * keep_activations the f32 gate/up pre-activations (f32 keeps recompute bitwise equal to
     * the kept values) and LoRA's x A^T of each projection (r floats each: rebuilding them
     * was a visible part of backward's recompute). The expert outputs
     * are not kept: the routing gradient <grad_y, down(a)> is taken as <grad_y down, a> in
     * backward. Summed from the buffers themselves, so the figure is what is held. */
    uint64_t per_call = 0;
    for (int i = 0; i < n; i++)
        per_call += s[i].ptr == (void **)&m->route.row_start ? 0 : s[i].bytes;
    m->mem.saved_bytes_per_token = per_call / T;
    return KT_OK;
}

static kt_status alloc_params(kt_moe *m)
{
    size_t per = 0, wg = 0;
    if (m->cfg.mode == KT_MOE_LORA)
        per = (size_t)(m->dim.E * 3 * m->dim.R * (m->dim.H + m->dim.I)) * sizeof(float);
    if (m->cfg.mode == KT_MOE_FULL)
        wg = (size_t)(m->dim.E * 3 * m->dim.H * m->dim.I) * sizeof(float);
    buf_spec s[3];
    int n = 0;
    if (per) {
        s[n++] = (buf_spec){(void **)&m->train.lora, per};
        s[n++] = (buf_spec){(void **)&m->train.lora_grad, per};
    }
    if (wg)
        s[n++] = (buf_spec){(void **)&m->train.weight_grad, wg};
    size_t total = 0;
    KT__TRY(carve(&m->train.arena, s, n, kt__moe_buffer_node(m), &total));
    if (wg)
        KT__TRY(bind_groups(m, m->train.weight_grad,
                            (size_t)(3 * m->dim.H * m->dim.I) * sizeof(float)));
    m->mem.grad_bytes = n ? total : 0;
    memset(m->train.arena.base, 0, m->train.arena.size);
    if (per) {
        for (int64_t e = 0; e < m->dim.E; e++)
            for (int p = 0; p < 3; p++) {
                float *a = kt__moe_lora_ptr(m, m->train.lora, e, p, 0);
                int64_t in = kt__moe_proj_in(m, p), cnt = m->dim.R * in;
                float bound = 1.0f / sqrtf((float)in);
                for (int64_t i = 0; i < cnt; i++) {
                    uint64_t g = (uint64_t)kt__moe_global_id(m, e);
                    uint64_t r = kt__splitmix64(LORA_SEED ^ kt__splitmix64(g * 3 + (uint64_t)p) ^
                                                (uint64_t)i * 0x100000001b3ull);
                    double u01 = (double)(r >> 11) * (1.0 / 9007199254740992.0);
                    a[i] = (float)((2.0 * u01 - 1.0) * bound);
                }
            }
    }
    return KT_OK;
}

/* Tasks of one phase: at most ceil(cols / 16) per expert, over the widest phase (every plan
 * cuts columns at multiples of 16, and its tasks of an expert do not overlap). */
static int64_t max_tasks_for(const kt_moe *m)
{
    int64_t cols = m->dim.H > m->dim.I ? m->dim.H : m->dim.I;
    return m->dim.E * ((cols + KT__MOE_COL_ALIGN - 1) / KT__MOE_COL_ALIGN);
}

/* The values a session's optimizer updates: the adapters (LoRA) or the weights (full). */
static uint64_t trainable_values(const kt_moe_config *c)
{
    const uint64_t E = (uint64_t)c->n_experts, H = (uint64_t)c->hidden,
                   I = (uint64_t)c->intermediate, R = (uint64_t)c->lora_rank;
    return c->mode == KT_MOE_LORA   ? E * 3 * R * (H + I)
           : c->mode == KT_MOE_FULL ? E * 3 * H * I
                                    : 0;
}

/* The weight store, and the adapters with their gradients (LoRA) or the weight gradients
 * (full): the parts that grow with the experts, as alloc_params sizes them. */
static uint64_t store_bytes(const kt_moe_config *c)
{
    if (c->quant != KT_MOE_QUANT_NONE)
        return (uint64_t)c->n_experts * kt__moe_quant_expert_bytes(c);
    return (uint64_t)c->n_experts * 3 * (uint64_t)c->hidden * (uint64_t)c->intermediate *
           kt_dtype_size(c->weight_dtype);
}

static uint64_t weight_bytes(const kt_moe_config *c)
{
    const uint64_t raw = store_bytes(c);
    const uint64_t trained = trainable_values(c) * sizeof(float);
    return raw + (c->mode == KT_MOE_LORA ? 2 * trained : trained);
}

kt_status kt_moe_memory_need(const kt_moe_config *config, int optimizer_states, uint64_t *bytes_out)
{
    if (config == NULL || bytes_out == NULL || optimizer_states < 0)
        return kt__error(KT_EINVAL, "kt_moe_memory_need: NULL argument or negative state count");
    KT__TRY(check_config(config));
    *bytes_out = weight_bytes(config) +
                 trainable_values(config) * sizeof(float) * (uint64_t)optimizer_states;
    return KT_OK;
}

kt_status kt_moe_create(const kt_moe_config *config, kt_threadpool *pool, kt_moe **moe_out)
{
    if (moe_out != NULL)
        *moe_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    if (config == NULL || moe_out == NULL)
        return kt__error(KT_EINVAL, "kt_moe_create: NULL argument");
    KT__TRY(check_config(config));
    char what[96];
    snprintf(what, sizeof what, "moe '%.40s': the expert weights%s",
             config->name ? config->name : "moe",
             config->mode == KT_MOE_FROZEN ? "" : " and their gradients");
    KT__TRY(kt__memory_admit(weight_bytes(config), what));
    kt_moe *m = calloc(1, sizeof *m);
    if (m == NULL)
        return kt__error(KT_ENOMEM, "kt_moe_create: out of memory");
    kt_status st = KT_OK;
    m->cfg = *config;
    snprintf(m->name, sizeof m->name, "%s", config->name ? config->name : "moe");
    m->cfg.name = m->name;
    if (config->expert_ids != NULL) {
        m->expert_ids = malloc((size_t)config->n_experts * sizeof *m->expert_ids);
        if (m->expert_ids == NULL) {
            free(m);
            return kt__error(KT_ENOMEM, "kt_moe_create: out of memory");
        }
        memcpy(m->expert_ids, config->expert_ids, (size_t)config->n_experts * sizeof *m->expert_ids);
    }
    m->cfg.expert_ids = m->expert_ids;
    if (m->cfg.mode != KT_MOE_LORA) {
        m->cfg.lora_rank = 0;
    }
    m->pool = pool;
    m->n_threads = kt_threadpool_size(pool);
    m->dim.bf16 = config->weight_dtype == KT_BF16;
    m->dim.quant = kt__moe_qfmt(config);
    m->dim.tiled = m->dim.bf16 || kt__f32_gemm_tiled();
    m->dim.cdt_bytes = kt_dtype_size(config->weight_dtype);
    m->dim.E = config->n_experts;
    m->dim.H = config->hidden;
    m->dim.ld_h =
        m->dim.H +
        ((size_t)m->dim.H * m->dim.cdt_bytes % 1024 == 0 ? (int64_t)(64 / m->dim.cdt_bytes) : 0);
    m->dim.I = config->intermediate;
    m->dim.K = config->top_k;
    m->dim.T = config->max_tokens;
    m->dim.N = m->dim.T * m->dim.K;
    m->dim.R = m->cfg.lora_rank;
    m->dim.lora_scale = m->dim.R ? config->lora_alpha / (float)m->dim.R : 0.0f;
    m->route.max_tasks = max_tasks_for(m);
    if (m->dim.quant) /* 64-byte multiples, so each thread's block stays aligned */
        m->store.q_work_bytes =
            round_up(kt__q_gemm_work_bytes(m->dim.H > m->dim.I ? m->dim.H : m->dim.I,
                                           m->dim.H > m->dim.I ? m->dim.H : m->dim.I, m->dim.N));
    m->train.grad_overwrite = 1;
    atomic_init(&m->cache.state, KT_MOE_CACHE_EMPTY);
    pthread_mutex_init(&m->async.mu, NULL);
    pthread_cond_init(&m->async.cv, NULL);

    st = plan_groups(m, pool);
    if (st != KT_OK)
        goto fail;
    /* The store is exactly the raw weights: no padding, no transposed copy. Pages are bound
     * to their group's node before the zeroing first touches them. */
    size_t wbytes = (size_t)store_bytes(config);
    st = kt_arena_create(&m->store.arena, wbytes, kt__moe_buffer_node(m));
    if (st == KT_OK)
        st = bind_groups(m, m->store.arena.base, wbytes / (size_t)m->dim.E);
    if (st != KT_OK)
        goto fail;
    m->store.weights = m->store.arena.base;
    memset(m->store.weights, 0, wbytes);
    if (m->dim.quant && (st = kt__moe_quant_bind(m)) != KT_OK)
        goto fail;
    st = alloc_params(m);
    if (st != KT_OK)
        goto fail;
    st = alloc_work(m);
    if (st != KT_OK)
        goto fail;
    *moe_out = m;
    return KT_OK;

fail:
    kt__error_context(st, "moe '%s': create", m->name);
    kt_moe_destroy(m);
    return st;
}

void kt_moe_destroy(kt_moe *moe)
{
    if (moe == NULL || !kt__moe_release(moe)) /* a session still holds it */
        return;
    if (moe->async.started) {
        pthread_mutex_lock(&moe->async.mu);
        moe->async.stop = 1;
        pthread_cond_broadcast(&moe->async.cv);
        pthread_mutex_unlock(&moe->async.mu);
        pthread_join(moe->async.thread, NULL);
    }
    pthread_cond_destroy(&moe->async.cv);
    pthread_mutex_destroy(&moe->async.mu);
    kt_arena_destroy(&moe->mem.kept);
    kt_arena_destroy(&moe->mem.staged_y);
    kt_arena_destroy(&moe->mem.own_scratch);
    kt_arena_destroy(&moe->train.arena);
    kt_arena_destroy(&moe->store.arena);
    free(moe->store.qmat);
    free(moe->expert_ids);
    free(moe);
}

void kt_moe_zero_grad(kt_moe *moe)
{
    if (moe != NULL)
        moe->train.grad_overwrite = 1;
}

void kt_moe_get_memory(const kt_moe *moe, kt_moe_memory *memory_out)
{
    if (moe == NULL || memory_out == NULL)
        return;
    memset(memory_out, 0, sizeof *memory_out);
    memory_out->raw_weight_bytes =
        (uint64_t)(moe->dim.E * 3 * moe->dim.H * moe->dim.I) * moe->dim.cdt_bytes;
    memory_out->weight_bytes = moe->store.arena.size;
    memory_out->backward_buffer_bytes = 0; /* the nn kernel reads the original layout */
    memory_out->saved_bytes_per_token = moe->mem.saved_bytes_per_token;
    memory_out->workspace_bytes = moe->mem.workspace_bytes;
    memory_out->scratch_bytes = moe->mem.scratch_need;
    memory_out->grad_bytes = moe->mem.grad_bytes;
}
