/* The MoE layer object: configuration checks, the weight store and every working buffer,
 * all sized at creation so that running the layer allocates nothing. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"
#include "core/mix.h"
#include "core/numa_internal.h"
#include "kernels/bf16_gemm.h"
#include "kernels/f32_gemm.h"
#include "moe/moe_internal.h"
#include "moe/trainable.h"

#define ALIGN 64

/* LoRA A is drawn from U(-1/sqrt(in), 1/sqrt(in)) (the bound PEFT's kaiming_uniform(a=sqrt(5))
 * gives), B is zero so the adapter starts as a no-op. Each value comes from splitmix64 of this
 * seed and its (expert, projection, index), so the init does not depend on creation order. */
#define LORA_SEED 0x6b742d6d6f652d41ull

int64_t kt__moe_proj_in(const kt_moe *m, int proj) { return proj == KT_MOE_DOWN ? m->I : m->H; }
int64_t kt__moe_proj_out(const kt_moe *m, int proj) { return proj == KT_MOE_DOWN ? m->H : m->I; }

void *kt__moe_weight_ptr(const kt_moe *m, int64_t e, int proj)
{
    return m->weights + (size_t)((e * 3 + proj) * m->H * m->I) * m->cs;
}

float *kt__moe_lora_ptr(const kt_moe *m, float *base, int64_t e, int proj, int which_b)
{
    float *a = base + (e * 3 + proj) * m->R * (m->H + m->I);
    return which_b ? a + m->R * kt__moe_proj_in(m, proj) : a;
}

uint64_t kt__moe_flops_run(const kt_moe *m) { return m->flops; }

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
    return KT_OK;
}

/* Node groups from the pool's thread placement (contiguous blocks of threads per node), the
 * experts cut into as many contiguous ranges; one group of everything without the split. */
static kt_status plan_groups(kt_moe *m, kt_threadpool *pool)
{
    m->n_groups = 1;
    m->group_node[0] = m->cfg.numa_node;
    m->group_e[0] = 0, m->group_e[1] = m->E;
    m->group_t[0] = 0, m->group_t[1] = m->n_threads;
    if (m->cfg.numa_node != KT_MOE_NUMA_SPLIT)
        return KT_OK;
    if (kt_threadpool_thread_node(pool, 0) < 0)
        return kt__error(KT_EINVAL,
                         "moe '%s': KT_MOE_NUMA_SPLIT needs a pool from "
                         "kt_threadpool_create_numa",
                         m->name);
    int g = 0;
    m->group_node[0] = kt_threadpool_thread_node(pool, 0);
    for (int t = 1; t < m->n_threads; t++) {
        int node = kt_threadpool_thread_node(pool, t);
        if (node == m->group_node[g])
            continue;
        if (++g >= KT__MOE_MAX_GROUPS)
            return kt__error(KT_EINVAL, "moe '%s': more than %d NUMA nodes", m->name,
                             KT__MOE_MAX_GROUPS);
        m->group_node[g] = node;
        m->group_t[g] = t;
    }
    m->n_groups = g + 1;
    m->group_t[m->n_groups] = m->n_threads;
    for (int i = 0; i <= m->n_groups; i++)
        m->group_e[i] = m->E * i / m->n_groups;
    return KT_OK;
}

/* Each group's rows of a per-expert array (bytes_per_expert each) onto its node. */
static kt_status bind_groups(const kt_moe *m, void *base, size_t bytes_per_expert)
{
    for (int g = 0; m->cfg.numa_node == KT_MOE_NUMA_SPLIT && g < m->n_groups; g++)
        KT__TRY(kt__numa_bind_range(
            (unsigned char *)base + (size_t)m->group_e[g] * bytes_per_expert,
            (size_t)(m->group_e[g + 1] - m->group_e[g]) * bytes_per_expert, m->group_node[g]));
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
    size_t N = (size_t)m->N, H = (size_t)m->H, I = (size_t)m->I, cs = m->cs, R = (size_t)m->R;
    size_t total = 0;
    m->n_scratch = 0;
#define SCRATCH(p, b)                                                                              \
    (m->scratch_ptr[m->n_scratch] = (void **)&(p), m->scratch_off[m->n_scratch++] = total,         \
     total += round_up(b))
/* p at the offset of the buffer placed at slot s: their lives in a call never overlap */
#define SCRATCH_OVER(p, s)                                                                         \
    (m->scratch_ptr[m->n_scratch] = (void **)&(p),                                                 \
     m->scratch_off[m->n_scratch++] = m->scratch_off[s])
    SCRATCH(m->cursor, (size_t)m->E * 8);
    SCRATCH(m->tasks, (size_t)m->max_tasks * sizeof(kt__moe_task));
    SCRATCH(m->part, ((size_t)m->n_threads + 1) * 8);
    SCRATCH(m->queue, (size_t)m->n_threads * sizeof(kt__moe_queue));
    const size_t ldh = (size_t)m->ldh;
    /* Backward's input gradients gx (f32 [N, H], 50 MB for dsv2lite at 1024 tokens) and
     * forward's expert outputs d (the same size) lie over two [N, ldh] buffers that are dead
     * whenever they live: in LoRA and full mode gyc and gdc (grad_y's per-slot copies, unused
     * in forward, and backward is done with them before it writes gx); in frozen mode xc and
     * gyc (forward is done with the gathered rows before the down GEMM writes d; backward
     * reads them only in its recompute, first). d lives only in forward: combine reads it,
     * and backward takes the routing gradient without it. */
    const int frozen = m->cfg.mode == KT_MOE_FROZEN;
    SCRATCH(m->ac, N * I * cs);
    const int xc_slot = m->n_scratch;
    SCRATCH(m->xc, N * ldh * cs);
    const int gyc_slot = m->n_scratch;
    SCRATCH(m->gyc, N * ldh * cs);
    if (!frozen)
        SCRATCH(m->gdc, N * ldh * cs);
    /* the pair ends here; should gx ever outgrow it, it would run on into space kept for it
     * (with ldh >= H the pair holds 4 N ldh >= N H 4 bytes in either dtype) */
    const int over_slot = frozen ? xc_slot : gyc_slot;
    if (m->scratch_off[over_slot] + round_up(N * H * 4) > total)
        total = m->scratch_off[over_slot] + round_up(N * H * 4);
    SCRATCH_OVER(m->gx, over_slot);
    SCRATCH_OVER(m->d, over_slot);
    SCRATCH(m->gwp, N * (size_t)kt__moe_gw_pieces(m) * 4);
    SCRATCH(m->row_w, N * 4);
    SCRATCH(m->ga,
            kt__moe_ga_per_thread(m) ? (size_t)m->n_threads * kt__moe_ga_floats(m) * 4 : N * I * 4);
    if (m->tiled && m->cfg.mode == KT_MOE_FULL && kt__moe_gemm_tn_work_bytes(m, m->T) > 0)
        SCRATCH(m->tnw, (size_t)m->n_threads * kt__moe_gemm_tn_work_bytes(m, m->T));
    SCRATCH(m->ggc, N * I * cs);
    SCRATCH(m->guc, N * I * cs);
    SCRATCH(m->gw, N * 4);
    if (!m->cfg.keep_activations) { /* recomputed in backward: nothing to keep */
        SCRATCH(m->g, N * I * 4);
        SCRATCH(m->u, N * I * 4);
    }
    if (m->cfg.mode == KT_MOE_LORA)
        for (int p = 0; p < 3; p++) {
            if (!m->cfg.keep_activations)
                SCRATCH(m->z[p], N * R * 4);
            SCRATCH(m->gz[p], N * R * 4);
        }
#undef SCRATCH
#undef SCRATCH_OVER
    return total ? total : ALIGN;
}

kt_status kt__moe_alloc_staged_y(kt_moe *m)
{
    if (m->y != NULL)
        return KT_OK;
    const size_t bytes = round_up((size_t)(m->T * m->H) * sizeof(float));
    KT__TRY(kt_arena_create(&m->y_mem, bytes, kt__moe_buffer_node(m)));
    m->y = (float *)(void *)m->y_mem.base;
    m->workspace_bytes += bytes;
    return KT_OK;
}

static kt_status alloc_work(kt_moe *m)
{
    size_t N = (size_t)m->N, T = (size_t)m->T, H = (size_t)m->H, I = (size_t)m->I;
    size_t cs = m->cs;
    size_t R = (size_t)m->R;
    buf_spec s[16];
    int n = 0;
#define SPEC(p, b) (s[n].ptr = (void **)&(p), s[n].bytes = (b), n++)
    SPEC(m->slot_expert, N * 4);
    SPEC(m->slot_w, N * 4);
    SPEC(m->slot_row, N * 4);
    SPEC(m->row_expert, N * 4);
    SPEC(m->off, ((size_t)m->E + 1) * 8);
    SPEC(m->xt, T * H * cs);
    if (m->cfg.keep_activations) {
        SPEC(m->g, N * I * 4);
        SPEC(m->u, N * I * 4);
        if (m->cfg.mode == KT_MOE_LORA)
            for (int p = 0; p < 3; p++)
                SPEC(m->z[p], N * R * 4);
    }
#undef SPEC
    size_t total = 0;
    KT__TRY(carve(&m->work, s, n, kt__moe_buffer_node(m), &total));
    m->scratch_need = plan_scratch(m);
    if (m->cfg.scratch != NULL) {
        KT__TRY(kt__moe_scratch_register(m->cfg.scratch, m->scratch_need));
    } else {
        KT__TRY(kt_arena_create(&m->scratch_own, m->scratch_need, kt__moe_buffer_node(m)));
        kt__moe_bind_scratch(m, m->scratch_own.base);
        total += m->scratch_need;
    }
    m->workspace_bytes = total;
    if (m->cfg.check_finite) /* the output is staged (forward.c) */
        KT__TRY(kt__moe_alloc_staged_y(m));
    /* Kept from forward to backward, the work buffers but the per-call expert offsets: the
     * routing (4 x 4 bytes per slot), the input in the compute dtype, and with
     * keep_activations the f32 gate/up pre-activations (f32 keeps recompute bitwise equal to
     * the kept values) and LoRA's x A^T of each projection (r floats each: rebuilding them
     * took a dozen ms of backward's recompute at dsv2lite's qlen 1024). The expert outputs
     * are not kept: the routing gradient <grad_y, down(a)> is taken as <grad_y down, a> in
     * backward. Summed from the buffers themselves, so the figure is what is held. */
    uint64_t per_call = 0;
    for (int i = 0; i < n; i++)
        per_call += s[i].ptr == (void **)&m->off ? 0 : s[i].bytes;
    m->saved_bytes_per_token = per_call / T;
    return KT_OK;
}

static kt_status alloc_params(kt_moe *m)
{
    size_t per = 0, wg = 0;
    if (m->cfg.mode == KT_MOE_LORA)
        per = (size_t)(m->E * 3 * m->R * (m->H + m->I)) * sizeof(float);
    if (m->cfg.mode == KT_MOE_FULL)
        wg = (size_t)(m->E * 3 * m->H * m->I) * sizeof(float);
    buf_spec s[3];
    int n = 0;
    if (per) {
        s[n++] = (buf_spec){(void **)&m->lora, per};
        s[n++] = (buf_spec){(void **)&m->lora_grad, per};
    }
    if (wg)
        s[n++] = (buf_spec){(void **)&m->wgrad, wg};
    size_t total = 0;
    KT__TRY(carve(&m->params, s, n, kt__moe_buffer_node(m), &total));
    if (wg)
        KT__TRY(bind_groups(m, m->wgrad, (size_t)(3 * m->H * m->I) * sizeof(float)));
    m->grad_bytes = n ? total : 0;
    memset(m->params.base, 0, m->params.size);
    if (per) {
        for (int64_t e = 0; e < m->E; e++)
            for (int p = 0; p < 3; p++) {
                float *a = kt__moe_lora_ptr(m, m->lora, e, p, 0);
                int64_t in = kt__moe_proj_in(m, p), cnt = m->R * in;
                float bound = 1.0f / sqrtf((float)in);
                for (int64_t i = 0; i < cnt; i++) {
                    uint64_t r = kt__splitmix64(LORA_SEED ^ kt__splitmix64((uint64_t)(e * 3 + p)) ^
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
    int64_t cols = m->H > m->I ? m->H : m->I;
    return m->E * ((cols + KT__MOE_COL_ALIGN - 1) / KT__MOE_COL_ALIGN);
}

/* The values a session's optimizer updates: the adapters (LoRA) or the weights (full). */
static uint64_t trainable_values(const kt_moe_config *c)
{
    const uint64_t E = (uint64_t)c->n_experts, H = (uint64_t)c->hidden,
                   I = (uint64_t)c->intermediate, R = (uint64_t)c->lora_rank;
    return c->mode == KT_MOE_LORA ? E * 3 * R * (H + I) : c->mode == KT_MOE_FULL ? E * 3 * H * I : 0;
}

/* The weight store, and the adapters with their gradients (LoRA) or the weight gradients
 * (full): the parts that grow with the experts, as alloc_params sizes them. */
static uint64_t weight_bytes(const kt_moe_config *c)
{
    const uint64_t raw = (uint64_t)c->n_experts * 3 * (uint64_t)c->hidden *
                         (uint64_t)c->intermediate * kt_dtype_size(c->weight_dtype);
    const uint64_t trained = trainable_values(c) * sizeof(float);
    return raw + (c->mode == KT_MOE_LORA ? 2 * trained : trained);
}

kt_status kt_moe_memory_need(const kt_moe_config *config, int optimizer_states,
                             uint64_t *bytes_out)
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
    snprintf(what, sizeof what, "moe '%.40s': the expert weights%s", config->name ? config->name
             : "moe", config->mode == KT_MOE_FROZEN ? "" : " and their gradients");
    KT__TRY(kt__memory_admit(weight_bytes(config), what));
    kt_moe *m = calloc(1, sizeof *m);
    if (m == NULL)
        return kt__error(KT_ENOMEM, "kt_moe_create: out of memory");
    kt_status st = KT_OK;
    m->cfg = *config;
    snprintf(m->name, sizeof m->name, "%s", config->name ? config->name : "moe");
    m->cfg.name = m->name;
    if (m->cfg.mode != KT_MOE_LORA) {
        m->cfg.lora_rank = 0;
    }
    m->pool = pool;
    m->n_threads = kt_threadpool_size(pool);
    m->bf16 = config->weight_dtype == KT_BF16;
    m->tiled = m->bf16 || kt__f32_gemm_tiled();
    m->cs = kt_dtype_size(config->weight_dtype);
    m->E = config->n_experts;
    m->H = config->hidden;
    m->ldh = m->H + ((size_t)m->H * m->cs % 1024 == 0 ? (int64_t)(64 / m->cs) : 0);
    m->I = config->intermediate;
    m->K = config->top_k;
    m->T = config->max_tokens;
    m->N = m->T * m->K;
    m->R = m->cfg.lora_rank;
    m->lora_scale = m->R ? config->lora_alpha / (float)m->R : 0.0f;
    m->max_tasks = max_tasks_for(m);
    m->grad_overwrite = 1;
    atomic_init(&m->cache_state, KT_MOE_CACHE_EMPTY);
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, NULL);

    st = plan_groups(m, pool);
    if (st != KT_OK)
        goto fail;
    /* The store is exactly the raw weights: no padding, no transposed copy. Pages are bound
     * to their group's node before the zeroing first touches them. */
    size_t wbytes = (size_t)(m->E * 3 * m->H * m->I) * m->cs;
    st = kt_arena_create(&m->store, wbytes, kt__moe_buffer_node(m));
    if (st == KT_OK)
        st = bind_groups(m, m->store.base, (size_t)(3 * m->H * m->I) * m->cs);
    if (st != KT_OK)
        goto fail;
    m->weights = m->store.base;
    memset(m->weights, 0, wbytes);
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
    if (moe->driver_started) {
        pthread_mutex_lock(&moe->mu);
        moe->stop = 1;
        pthread_cond_broadcast(&moe->cv);
        pthread_mutex_unlock(&moe->mu);
        pthread_join(moe->driver, NULL);
    }
    pthread_cond_destroy(&moe->cv);
    pthread_mutex_destroy(&moe->mu);
    kt_arena_destroy(&moe->work);
    kt_arena_destroy(&moe->y_mem);
    kt_arena_destroy(&moe->scratch_own);
    kt_arena_destroy(&moe->params);
    kt_arena_destroy(&moe->store);
    free(moe);
}

void kt_moe_zero_grad(kt_moe *moe)
{
    if (moe != NULL)
        moe->grad_overwrite = 1;
}

void kt_moe_get_memory(const kt_moe *moe, kt_moe_memory *memory_out)
{
    if (moe == NULL || memory_out == NULL)
        return;
    memset(memory_out, 0, sizeof *memory_out);
    memory_out->raw_weight_bytes = (uint64_t)(moe->E * 3 * moe->H * moe->I) * moe->cs;
    memory_out->weight_bytes = moe->store.size;
    memory_out->backward_buffer_bytes = 0; /* the nn kernel reads the original layout */
    memory_out->saved_bytes_per_token = moe->saved_bytes_per_token;
    memory_out->workspace_bytes = moe->workspace_bytes;
    memory_out->scratch_bytes = moe->scratch_need;
    memory_out->grad_bytes = moe->grad_bytes;
}
