/* Scratch buffers shared by MoE layers (kt/moe.h: kt_moe_scratch). */
#include <pthread.h>
#include <stdlib.h>

#include "lib/core/error.h"
#include "lib/moe/moe_internal.h"

struct kt_moe_scratch {
    pthread_mutex_t mu; /* held for a whole call of one layer */
    kt_arena arena;
    size_t need; /* the largest need registered so far */
    int numa_node;
};

kt_status kt_moe_scratch_create(int numa_node, kt_moe_scratch **scratch_out)
{
    if (scratch_out != NULL)
        *scratch_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    if (scratch_out == NULL)
        return kt__error(KT_EINVAL, "kt_moe_scratch_create: scratch_out is NULL");
    if (numa_node < -1)
        return kt__error(KT_EINVAL, "kt_moe_scratch_create: numa_node %d is invalid", numa_node);
    kt_moe_scratch *s = calloc(1, sizeof *s);
    if (s == NULL)
        return kt__error(KT_ENOMEM, "kt_moe_scratch_create: out of memory");
    pthread_mutex_init(&s->mu, NULL);
    s->numa_node = numa_node;
    *scratch_out = s;
    return KT_OK;
}

void kt_moe_scratch_destroy(kt_moe_scratch *s)
{
    if (s == NULL)
        return;
    kt_arena_destroy(&s->arena);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

uint64_t kt_moe_scratch_bytes(const kt_moe_scratch *s) { return s ? s->arena.size : 0; }

kt_status kt__moe_scratch_register(kt_moe_scratch *s, size_t need)
{
    pthread_mutex_lock(&s->mu);
    if (need > s->need)
        s->need = need;
    pthread_mutex_unlock(&s->mu);
    return KT_OK;
}

kt_status kt__moe_scratch_acquire(kt_moe *m)
{
    kt_moe_scratch *s = m->cfg.scratch;
    if (s == NULL)
        return KT_OK;
    pthread_mutex_lock(&s->mu);
    if (s->arena.base == NULL || s->arena.size < s->need) {
        /* grow: nothing in the scratch outlives a call, so the old contents can go */
        kt_arena_destroy(&s->arena);
        kt_status st = kt_arena_create(&s->arena, s->need, s->numa_node);
        if (st != KT_OK) {
            pthread_mutex_unlock(&s->mu);
            return kt__error_context(st, "moe '%s': shared scratch of %zu bytes", m->name, s->need);
        }
    }
    kt__moe_bind_scratch(m, s->arena.base);
    return KT_OK;
}

void kt__moe_bind_scratch(kt_moe *m, void *base)
{
    for (int i = 0; i < m->mem.n_scratch; i++)
        *m->mem.scratch_ptr[i] = (unsigned char *)base + m->mem.scratch_off[i];
}

void kt__moe_scratch_release(kt_moe *m)
{
    if (m->cfg.scratch != NULL)
        pthread_mutex_unlock(&m->cfg.scratch->mu);
}
