/* rope's session hooks (ops/op_state.h): when a session is bound, one cos/sin table
 * [max_positions, rotary_dim/2] per distinct key among its rope nodes (rope.h), filled by
 * kt__rope_angles, so the steps only read it. Forward, backward and recomputed steps find
 * their table by their attributes' key; nothing else of the session concerns rope. */
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/ops/op_state.h"
#include "lib/ops/rope.h"

const kt__rope_table *kt__rope_find(const kt__rope_tables *s, const kt__rope_key *k)
{
    for (int i = 0; s != NULL && i < s->n_tables; i++)
        if (memcmp(&s->tables[i].key, k, sizeof *k) == 0)
            return &s->tables[i];
    return NULL;
}

static void unbind_rope(void *state)
{
    kt__rope_tables *s = state;
    if (s == NULL)
        return;
    for (int i = 0; i < s->n_tables; i++) {
        free(s->tables[i].cos);
        free(s->tables[i].sin);
    }
    free(s->tables);
    free(s);
}

static kt_status fill_table(kt__rope_table *t, const kt__op_node *nd)
{
    kt__rope_freqs f;
    kt__rope_freqs_of(&t->key, &f);
    t->half = f.half;
    const uint64_t n = (uint64_t)t->key.max_positions * (uint64_t)f.half;
    if (n > SIZE_MAX / sizeof(float) ||
        (t->cos = malloc((size_t)n * sizeof(float) + 1)) == NULL ||
        (t->sin = malloc((size_t)n * sizeof(float) + 1)) == NULL)
        return kt__error(KT_ENOMEM, "session: rope node '%s': cannot allocate 2 x %llu bytes "
                         "for its cos/sin table (max_positions = %lld, rotary_dim = %d)",
                         nd->name, (unsigned long long)(n * sizeof(float)),
                         (long long)t->key.max_positions, (int)t->key.rotary_dim);
    for (int64_t p = 0; p < t->key.max_positions; p++)
        kt__rope_angles(&f, p, t->cos + p * f.half, t->sin + p * f.half);
    return KT_OK;
}

static kt_status bind_rope(const kt__op_bind *b, void **state_out)
{
    *state_out = NULL;
    if (b->n_nodes == 0)
        return KT_OK;
    kt__rope_tables *s = calloc(1, sizeof *s);
    if (s == NULL || (s->tables = calloc((size_t)b->n_nodes, sizeof *s->tables)) == NULL) {
        free(s);
        return kt__error(KT_ENOMEM, "session: out of memory");
    }
    for (int i = 0; i < b->n_nodes; i++) {
        const kt__op_node *nd = &b->nodes[i];
        const kt_tensor *x = &nd->in[0];
        const kt__rope_key key = kt__rope_key_of(nd->attrs, x->shape[x->ndim - 1]);
        if (kt__rope_find(s, &key) != NULL)
            continue;
        kt__rope_table *t = &s->tables[s->n_tables++]; /* counted first: unbind frees it */
        t->key = key;
        kt_status st = fill_table(t, nd);
        if (st != KT_OK) {
            unbind_rope(s);
            return st;
        }
    }
    *state_out = s;
    return KT_OK;
}

const kt__op_state kt__rope_state = {.bind = bind_rope, .unbind = unbind_rope};
