/* The parser's names: constants, loop variables, inputs, parameters and op outputs in one
 * hash table (open addressing), so that a repeat expanding to thousands of names stays
 * linear. Entries are never removed: a finished loop's variable is marked unbound. */
#include <stdlib.h>
#include <string.h>

#include "graph/ktg/ktg_internal.h"

static uint32_t hash(const char *s)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 16777619u;
    return h;
}

const char *kt__ktg_sym_name(const kt__ktg_symbols *t, const kt__ktg_sym *s)
{
    return kt__strings_get(&t->names, s->name);
}

static int32_t *slot_of(kt__ktg_symbols *t, const char *name)
{
    if (t->n_slots == 0)
        return NULL;
    uint32_t mask = t->n_slots - 1;
    for (uint32_t i = hash(name) & mask;; i = (i + 1) & mask) {
        int32_t *slot = &t->slots[i];
        if (*slot < 0 || strcmp(kt__ktg_sym_name(t, &t->syms[*slot]), name) == 0)
            return slot; /* the load factor stays under 1/2, so an empty slot exists */
    }
}

kt__ktg_sym *kt__ktg_sym_find(kt__ktg_symbols *t, const char *name)
{
    int32_t *slot = slot_of(t, name);
    return slot != NULL && *slot >= 0 ? &t->syms[*slot] : NULL;
}

static int grow_slots(kt__ktg_symbols *t)
{
    uint32_t n = t->n_slots ? t->n_slots * 2 : 64;
    int32_t *slots = malloc((size_t)n * sizeof *slots);
    if (slots == NULL)
        return 0;
    free(t->slots);
    t->slots = slots;
    t->n_slots = n;
    for (uint32_t i = 0; i < n; i++)
        slots[i] = -1;
    for (int32_t s = 0; s < t->n; s++)
        *slot_of(t, kt__ktg_sym_name(t, &t->syms[s])) = s;
    return 1;
}

kt__ktg_sym *kt__ktg_sym_get(kt__ktg_symbols *t, const char *name)
{
    kt__ktg_sym *found = kt__ktg_sym_find(t, name);
    if (found != NULL)
        return found;
    if ((uint32_t)(t->n + 1) * 2 > t->n_slots && !grow_slots(t))
        return NULL;
    if (t->n == t->cap) {
        int32_t cap = t->cap ? t->cap * 2 : 64;
        kt__ktg_sym *syms = realloc(t->syms, (size_t)cap * sizeof *syms);
        if (syms == NULL)
            return NULL;
        t->syms = syms;
        t->cap = cap;
    }
    kt__ktg_sym s;
    memset(&s, 0, sizeof s);
    s.kind = KT__KTG_SYM_NONE;
    if (kt__strings_add(&t->names, name, &s.name) != KT_OK)
        return NULL;
    t->syms[t->n] = s;
    *slot_of(t, name) = t->n;
    return &t->syms[t->n++];
}

void kt__ktg_sym_free(kt__ktg_symbols *t)
{
    free(t->syms);
    free(t->slots);
    kt__strings_free(&t->names);
    memset(t, 0, sizeof *t);
}
