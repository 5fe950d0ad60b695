/* The program as a Graphviz digraph (kt-graphc --dot): steps and buffers as nodes, an edge
 * from every buffer a step reads and to every buffer it writes. Steps are coloured by what
 * they do, so the forward pass, the backward pass and (with the checkpoint pass) the
 * recomputed segments can be told apart at a glance. */
#include <stdarg.h>
#include <stdio.h>

#include "graph/program_internal.h"
#include "lib/core/text.h"

/* A name inside a double-quoted DOT string: quotes and backslashes escaped, control
 * characters dropped (names come from user files). */
static void say_escaped(kt__text *t, const char *s)
{
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            kt__say(t, "\\%c", c);
        else if (c >= 0x20)
            kt__say(t, "%c", c);
    }
}

/* The hook for step colours: forward lightblue, backward salmon, fills and gradient
 * accumulation grey. The checkpoint pass will flag the forward steps it re-runs during
 * backward; test that flag here first and return "palegreen" for them. (Position alone
 * cannot tell: the backward schedule already holds forward-kind add steps that sum
 * partial gradients.) */
static const char *step_colour(const kt_program *p, int32_t at)
{
    if (p->steps[at].flags & KT__STEP_RECOMPUTE)
        return "palegreen";
    switch ((kt__step_kind)p->steps[at].kind) {
    case KT__STEP_FORWARD:
        return "lightblue";
    case KT__STEP_BACKWARD:
        return "salmon";
    default:
        return "grey";
    }
}

/* The input, parameter or output a buffer holds, if any. */
static const char *entry_name(const kt_program *p, int32_t buf, const char **role_out)
{
    static const char *const roles[3] = {"input", "param", "output"};
    for (int r = 0; r < 3; r++)
        for (int32_t i = 0; i < p->n_entries[r]; i++) {
            const kt__pentry *e = &p->entries[r][i];
            if (e->buf == buf) {
                *role_out = roles[r];
                return kt__strings_get(&p->strings, e->name);
            }
            if (r == KT_ROLE_PARAM && e->grad_buf == buf) {
                *role_out = "grad";
                return kt__strings_get(&p->strings, e->name);
            }
        }
    return NULL;
}

static void edge_in(kt__text *t, int32_t buf, int32_t step)
{
    if (buf >= 0)
        kt__say(t, "  b%d -> s%d;\n", buf, step);
}

static void edge_out(kt__text *t, int32_t step, int32_t buf)
{
    if (buf >= 0)
        kt__say(t, "  s%d -> b%d;\n", step, buf);
}

size_t kt_program_dot(const kt_program *p, char *buf, size_t size)
{
    kt__text t = {buf, size, 0};
    if (buf != NULL && size > 0)
        buf[0] = '\0';
    if (p == NULL)
        return 0;
    static const char *const kinds[KT__STEP_KIND_COUNT] = {"fwd", "bwd", "fill", "accum"};
    static const char *const shapes[KT__REGION_COUNT] = {"ellipse", "box3d", "note"};
    kt__say(&t, "digraph program {\n  rankdir=TB;\n  node [fontname=\"Helvetica\", fontsize=10];\n");
    for (int32_t b = 0; b < p->n_bufs; b++) {
        const kt__pbuf *pb = &p->bufs[b];
        char d[96];
        const char *role = NULL, *name = entry_name(p, b, &role);
        kt__say(&t, "  b%d [shape=%s, label=\"b%d %s", b,
            (unsigned)pb->region < KT__REGION_COUNT ? shapes[pb->region] : "ellipse", b,
            kt_tensor_describe(&pb->meta, d, sizeof d));
        if (name != NULL) {
            kt__say(&t, "\\n%s ", role);
            say_escaped(&t, name);
        }
        kt__say(&t, "\"];\n");
    }
    for (int32_t at = 0; at < p->n_steps; at++) {
        const kt__pstep *s = &p->steps[at];
        int known = (unsigned)s->kind < KT__STEP_KIND_COUNT;
        kt__say(&t, "  s%d [shape=box, style=filled, fillcolor=%s, label=\"%d %s %s", at,
            step_colour(p, at), at, known ? kinds[s->kind] : "?",
            s->kind <= KT__STEP_BACKWARD ? kt_op_name(s->op) : "");
        if (s->name >= 0) {
            kt__say(&t, "\\n");
            say_escaped(&t, kt__strings_get(&p->strings, s->name));
        }
        kt__say(&t, "\"];\n");
        for (int32_t i = 0; i < s->n_in; i++)
            edge_in(&t, s->in[i], at);
        if (s->kind == KT__STEP_BACKWARD) {
            for (int32_t o = 0; o < s->n_out; o++) {
                edge_in(&t, s->out[o], at);
                edge_in(&t, s->gout[o], at);
            }
            for (int32_t i = 0; i < s->n_in; i++)
                edge_out(&t, at, s->gin[i]);
        } else {
            for (int32_t o = 0; o < s->n_out; o++)
                edge_out(&t, at, s->out[o]);
        }
        if (s->scratch >= 0)
            kt__say(&t, "  s%d -> b%d [style=dotted];\n", at, s->scratch);
    }
    kt__say(&t, "}\n");
    return t.len;
}
