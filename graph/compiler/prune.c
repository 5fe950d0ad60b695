/* Common-subexpression elimination, then dead-code elimination.
 *
 * CSE: a node with the same op, attributes and (canonical) inputs as an earlier node is the
 * same computation; its outputs are remapped to the earlier node's. Attributes compare as
 * the op's table entry lists them (ops/attrs.h), so a new attribute takes part by itself.
 * DCE: only nodes that an output or the loss depends on are kept. Parameters and inputs are
 * never removed (the caller sets them by name). */
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "graph/compiler/compiler.h"
#include "lib/ops/attrs.h"

static uint64_t node_hash(const kt__gnode *n, const int32_t *remap)
{
    uint64_t h = 1469598103934665603ull ^ (uint64_t)n->op;
    for (int32_t i = 0; i < n->n_in; i++)
        h = (h ^ (uint64_t)(uint32_t)remap[n->in[i]]) * 1099511628211ull;
    return h ^ (uint64_t)n->n_in;
}

static int same_computation(const kt__gnode *a, const kt__gnode *b, const int32_t *remap)
{
    if (a->op != b->op || a->n_in != b->n_in || !kt__attrs_equal(a->op, &a->attrs, &b->attrs))
        return 0;
    for (int32_t i = 0; i < a->n_in; i++)
        if (remap[a->in[i]] != remap[b->in[i]])
            return 0;
    return 1;
}

static kt_status cse(kt__compiler *c, char *duplicate)
{
    const kt_graph *g = c->g;
    if (c->opt.no_cse || g->n_nodes == 0)
        return KT_OK;
    size_t cap = 1;
    while (cap < (size_t)g->n_nodes * 2)
        cap <<= 1;
    int32_t *table = malloc(cap * sizeof *table);
    if (table == NULL)
        return kt__error(KT_ENOMEM, "compile: out of memory");
    for (size_t i = 0; i < cap; i++)
        table[i] = -1;
    for (int32_t n = 0; n < g->n_nodes; n++) {
        const kt__gnode *node = &g->nodes[n];
        size_t slot = (size_t)node_hash(node, c->remap) & (cap - 1);
        for (;; slot = (slot + 1) & (cap - 1)) {
            int32_t other = table[slot];
            if (other < 0) {
                table[slot] = n;
                break;
            }
            if (same_computation(&g->nodes[other], node, c->remap)) {
                duplicate[n] = 1;
                for (int32_t o = 0; o < node->n_out; o++)
                    c->remap[node->out[o]] = g->nodes[other].out[o];
                break;
            }
        }
    }
    free(table);
    return KT_OK;
}

kt_status kt__pass_cse_dce(kt__compiler *c)
{
    const kt_graph *g = c->g;
    for (int32_t v = 0; v < g->n_values; v++)
        c->remap[v] = v;
    char *duplicate = calloc((size_t)g->n_nodes + 1, 1);
    char *needed = calloc((size_t)g->n_values + 1, 1);
    kt_status status = KT_OK;
    if (duplicate == NULL || needed == NULL) {
        status = kt__error(KT_ENOMEM, "compile: out of memory");
        goto out;
    }
    if ((status = cse(c, duplicate)) != KT_OK)
        goto out;
    for (int32_t o = 0; o < g->n_outputs; o++)
        needed[c->remap[g->outputs[o].value]] = 1;
    if (g->loss >= 0)
        needed[c->remap[g->loss]] = 1;
    /* graph order is topological, so one reverse sweep finds every needed node */
    for (int32_t n = g->n_nodes - 1; n >= 0; n--) {
        const kt__gnode *node = &g->nodes[n];
        if (duplicate[n])
            continue;
        int live = 0;
        for (int32_t o = 0; o < node->n_out; o++)
            live |= needed[node->out[o]];
        if (!live)
            continue;
        c->node_live[n] = 1;
        for (int32_t i = 0; i < node->n_in; i++)
            needed[c->remap[node->in[i]]] = 1;
    }
out:
    free(duplicate);
    free(needed);
    return status;
}
