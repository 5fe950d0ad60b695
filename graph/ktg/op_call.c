/* Op calls: NAME [, NAME] = op(values, attr = value, ...). The op is looked up by its name
 * in the op table; each attribute name maps to one field of kt_op_attrs (the table in
 * docs/ktg.md), and the builder then checks shapes and dtypes. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "graph/ktg/ktg_internal.h"

typedef enum attr_type { A_BOOL, A_INT, A_I64, A_FLOAT, A_MODE, A_HALO_MODE, A_SHAPE } attr_type;

typedef struct attr_desc {
    kt_op op;
    const char *name;
    attr_type type;
    size_t offset; /* of the field in kt_op_attrs */
    int required;  /* no default: a zero would silently mean something else (scale by 0) */
} attr_desc;

enum { OPTIONAL = 0, REQUIRED = 1 };

static const attr_desc attr_table[] = {
    {KT_OP_MATMUL, "trans_a", A_BOOL, offsetof(kt_op_attrs, trans_a), OPTIONAL},
    {KT_OP_MATMUL, "trans_b", A_BOOL, offsetof(kt_op_attrs, trans_b), OPTIONAL},
    {KT_OP_SCALE, "alpha", A_FLOAT, offsetof(kt_op_attrs, alpha), REQUIRED},
    {KT_OP_RMSNORM, "eps", A_FLOAT, offsetof(kt_op_attrs, eps), OPTIONAL},
    {KT_OP_CROSS_ENTROPY, "ignore_index", A_I64, offsetof(kt_op_attrs, ignore_index), OPTIONAL},
    {KT_OP_TOPK_ROUTER, "k", A_INT, offsetof(kt_op_attrs, k), REQUIRED},
    {KT_OP_TOPK_ROUTER, "norm_topk", A_BOOL, offsetof(kt_op_attrs, norm_topk), OPTIONAL},
    {KT_OP_CONV1D, "mode", A_MODE, offsetof(kt_op_attrs, conv_mode), OPTIONAL},
    {KT_OP_CONV1D, "depthwise", A_BOOL, offsetof(kt_op_attrs, depthwise), OPTIONAL},
    {KT_OP_CONCAT, "dim", A_INT, offsetof(kt_op_attrs, dim), OPTIONAL},
    {KT_OP_NARROW, "dim", A_INT, offsetof(kt_op_attrs, dim), REQUIRED},
    {KT_OP_NARROW, "start", A_I64, offsetof(kt_op_attrs, start), REQUIRED},
    {KT_OP_NARROW, "length", A_I64, offsetof(kt_op_attrs, length), REQUIRED},
    {KT_OP_TRANSPOSE, "dim0", A_INT, offsetof(kt_op_attrs, dim0), REQUIRED},
    {KT_OP_TRANSPOSE, "dim1", A_INT, offsetof(kt_op_attrs, dim1), REQUIRED},
    {KT_OP_RESHAPE, "shape", A_SHAPE, offsetof(kt_op_attrs, shape), REQUIRED},
    {KT_OP_MOE, "layer", A_INT, offsetof(kt_op_attrs, binding), OPTIONAL},
    {KT_OP_HALO, "dim", A_INT, offsetof(kt_op_attrs, dim), OPTIONAL},
    {KT_OP_HALO, "left", A_I64, offsetof(kt_op_attrs, halo_left), OPTIONAL},
    {KT_OP_HALO, "right", A_I64, offsetof(kt_op_attrs, halo_right), OPTIONAL},
    {KT_OP_HALO, "mode", A_HALO_MODE, offsetof(kt_op_attrs, halo_mode), OPTIONAL},
};
enum { N_ATTRS = sizeof attr_table / sizeof attr_table[0] };

static const char *const mode_names[] = {"causal", "same", "valid"};
static const char *const halo_mode_names[] = {"p2p", "allgather"};

/* "trans_a or trans_b", "dim, start or length" */
static void allowed_list(kt_op op, const char **names, int *n, char *buf, size_t size)
{
    *n = 0;
    for (int i = 0; i < N_ATTRS; i++)
        if (attr_table[i].op == op)
            names[(*n)++] = attr_table[i].name;
    size_t len = 0;
    buf[0] = '\0';
    for (int i = 0; i < *n && len < size; i++) {
        const char *sep = i == 0 ? "" : i == *n - 1 ? " or " : ", ";
        int w = snprintf(buf + len, size - len, "%s%s", sep, names[i]);
        if (w > 0)
            len += (size_t)w;
    }
}

static int unknown_attr(kt__ktg_parser *p, kt_op op, const char *word, kt__ktg_span at)
{
    const char *names[N_ATTRS];
    int n;
    char list[160];
    allowed_list(op, names, &n, list, sizeof list);
    if (n == 0)
        return kt__ktg_error(p, at, "unknown attribute '%s' ('%s' takes no attributes), "
                             "expected only values", word, kt_op_name(op));
    const char *near = kt__ktg_suggest(word, names, n);
    if (near != NULL)
        return kt__ktg_error(p, at, "unknown attribute '%s' for '%s' (did you mean '%s'?), "
                             "expected %s", word, kt_op_name(op), near, list);
    return kt__ktg_error(p, at, "unknown attribute '%s' for '%s', expected %s", word,
                         kt_op_name(op), list);
}

static int int_value(kt__ktg_parser *p, const attr_desc *d, int64_t lo, int64_t hi,
                     int64_t *v)
{
    kt__ktg_span start = p->tok.at;
    if (!kt__ktg_expr(p, v))
        return 0;
    if (*v < lo || *v > hi) {
        if (d->type == A_BOOL)
            return kt__ktg_error(p, kt__ktg_span_to_here(p, start), "%s = %lld, expected 0 or "
                                 "1", d->name, (long long)*v);
        return kt__ktg_error(p, kt__ktg_span_to_here(p, start), "%s = %lld, expected a value "
                             "in %lld..%lld", d->name, (long long)*v, (long long)lo,
                             (long long)hi);
    }
    return 1;
}

/* A word naming one of an enum's values (its index in names). */
static int word_value(kt__ktg_parser *p, const char *const *names, int n, const char *what,
                      const char *expected, int *index)
{
    if (p->tok.kind != KT__KTG_IDENT)
        return kt__ktg_expected(p, expected);
    char word[64];
    kt__ktg_text(p, &p->tok, word, sizeof word);
    for (int i = 0; i < n; i++)
        if (p->tok.at.len == strlen(names[i]) && strcmp(word, names[i]) == 0) {
            *index = i;
            kt__ktg_advance(p);
            return 1;
        }
    const char *near = kt__ktg_suggest(word, names, n);
    if (near != NULL)
        return kt__ktg_error(p, p->tok.at, "unknown %s '%s' (did you mean '%s'?), expected %s",
                             what, word, near, expected);
    return kt__ktg_error(p, p->tok.at, "unknown %s '%s', expected %s", what, word, expected);
}

/* IDENT "=" value, with the current token at IDENT. */
static int attribute(kt__ktg_parser *p, kt_op op, kt_op_attrs *attrs, unsigned *given)
{
    kt__ktg_token t = p->tok;
    char word[64];
    kt__ktg_text(p, &t, word, sizeof word);
    int which = -1;
    for (int i = 0; i < N_ATTRS; i++)
        if (attr_table[i].op == op && t.at.len == strlen(attr_table[i].name) &&
            strcmp(word, attr_table[i].name) == 0)
            which = i;
    if (which < 0)
        return unknown_attr(p, op, word, t.at);
    if (*given & (1u << which))
        return kt__ktg_error(p, t.at, "attribute '%s' given twice, expected each attribute "
                             "once", word);
    *given |= 1u << which;
    kt__ktg_advance(p);
    kt__ktg_advance(p); /* the '=' (checked by the caller's look-ahead) */
    const attr_desc *d = &attr_table[which];
    char *field = (char *)attrs + d->offset;
    int64_t v;
    double f;
    switch (d->type) {
    case A_BOOL:
    case A_INT:
        if (!int_value(p, d, d->type == A_BOOL ? 0 : -((int64_t)1 << 30),
                       d->type == A_BOOL ? 1 : (int64_t)1 << 30, &v))
            return 0;
        *(int *)(void *)field = (int)v;
        return 1;
    case A_I64:
        if (!int_value(p, d, INT64_MIN, INT64_MAX, &v))
            return 0;
        memcpy(field, &v, sizeof v);
        return 1;
    case A_FLOAT:
        if (!kt__ktg_number(p, &f))
            return 0;
        *(float *)(void *)field = (float)f;
        return 1;
    case A_MODE: {
        int i;
        if (!word_value(p, mode_names, 3, "conv1d mode", "causal, same or valid", &i))
            return 0;
        attrs->conv_mode = (kt_conv_mode)i; /* the enum's values are the names' order */
        return 1;
    }
    case A_HALO_MODE: {
        int i;
        if (!word_value(p, halo_mode_names, 2, "halo mode", "p2p or allgather", &i))
            return 0;
        attrs->halo_mode = (kt_halo_mode)i;
        return 1;
    }
    case A_SHAPE: {
        int ndim;
        if (!kt__ktg_dims(p, attrs->shape, &ndim, 0))
            return 0;
        attrs->ndim = ndim;
        return 1;
    }
    }
    return 0;
}

static int lookup_op(kt__ktg_parser *p, kt_op *op)
{
    if (p->tok.kind != KT__KTG_IDENT)
        return kt__ktg_expected(p, "an op name");
    char word[64];
    kt__ktg_token t = p->tok;
    kt__ktg_text(p, &t, word, sizeof word);
    if (t.at.len < sizeof word && kt_op_from_name(word, op) == KT_OK) {
        kt__ktg_advance(p);
        return 1;
    }
    const char *names[KT_OP_COUNT];
    for (int i = 0; i < KT_OP_COUNT; i++)
        names[i] = kt_op_name((kt_op)i);
    const char *near = kt__ktg_suggest(word, names, KT_OP_COUNT);
    if (near != NULL)
        return kt__ktg_error(p, t.at, "unknown op '%s' (did you mean '%s'?)", word, near);
    return kt__ktg_error(p, t.at, "unknown op '%s', expected an op of the table in "
                         "docs/ktg.md (matmul, add, silu, ...)", word);
}

/* The closing ')' at `at`: every attribute the op cannot do without was given. */
static int required_given(kt__ktg_parser *p, kt_op op, unsigned given, kt__ktg_span at)
{
    for (int i = 0; i < N_ATTRS; i++)
        if (attr_table[i].op == op && attr_table[i].required && !(given & (1u << i)))
            return kt__ktg_error(p, at, "'%s' needs %s, expected %s = value", kt_op_name(op),
                                 attr_table[i].name, attr_table[i].name);
    return 1;
}

/* "(" [ value { "," value } ] { "," attr = value } ")" */
static int arguments(kt__ktg_parser *p, kt_op op, kt_value *in, int *n_in, kt_op_attrs *attrs)
{
    if (!kt__ktg_expect(p, KT__KTG_LPAREN, "'(' and the op's arguments"))
        return 0;
    unsigned given = 0;
    *n_in = 0;
    if (p->tok.kind == KT__KTG_RPAREN) {
        kt__ktg_span close = p->tok.at;
        kt__ktg_advance(p);
        return required_given(p, op, given, close);
    }
    for (;;) {
        if (p->tok.kind == KT__KTG_IDENT && kt__ktg_peek(p).kind == KT__KTG_EQ) {
            if (!attribute(p, op, attrs, &given))
                return 0;
        } else {
            if (given != 0)
                return kt__ktg_error(p, p->tok.at, "a value after the attributes, expected "
                                     "values first, then name = value");
            if (*n_in == KT_OP_MAX_IN)
                return kt__ktg_error(p, p->tok.at, "too many values, expected at most %d",
                                     KT_OP_MAX_IN);
            if (p->tok.kind != KT__KTG_IDENT)
                return kt__ktg_expected(p, "a value's name or an attribute (name = value)");
            if (!kt__ktg_value_ref(p, &in[*n_in], NULL, NULL))
                return 0;
            (*n_in)++;
        }
        if (p->tok.kind == KT__KTG_COMMA) {
            kt__ktg_advance(p);
            continue;
        }
        kt__ktg_span close = p->tok.at;
        return kt__ktg_expect(p, KT__KTG_RPAREN, "',' or ')'") &&
               required_given(p, op, given, close);
    }
}

/* The names before '=' may be rebound, but not when they name an integer. */
static int check_target(kt__ktg_parser *p, const char *name, kt__ktg_span at)
{
    const kt__ktg_sym *s = kt__ktg_sym_find(&p->syms, name);
    if (s != NULL && (s->kind == KT__KTG_SYM_CONST || s->kind == KT__KTG_SYM_LOOPVAR))
        return kt__ktg_error(p, at, "'%s' is an integer %s (line %d), expected a tensor's "
                             "name", name, s->kind == KT__KTG_SYM_CONST ? "constant"
                                                                         : "loop variable",
                             s->line);
    return 1;
}

/* Binds each name to its value, or (failed) to a broken marker that silences later uses. */
static void bind_names(kt__ktg_parser *p, char (*names)[KT__KTG_NAME_MAX + 1],
                       const kt__ktg_span *spans, int n_names, const kt_value *outs, int failed)
{
    for (int i = 0; i < n_names; i++) {
        kt__ktg_sym *s = kt__ktg_sym_get(&p->syms, names[i]);
        if (s == NULL) {
            kt__ktg_error(p, spans[i], "out of memory for names, expected a smaller model");
            return;
        }
        if (s->kind == KT__KTG_SYM_CONST || s->kind == KT__KTG_SYM_LOOPVAR)
            continue; /* reported by check_target */
        if (s->kind != KT__KTG_SYM_LEAF && s->kind != KT__KTG_SYM_VALUE) {
            s->line = spans[i].line;
            s->col = spans[i].col;
        }
        s->kind = failed ? KT__KTG_SYM_BROKEN : KT__KTG_SYM_VALUE;
        s->is_input = 0;
        if (!failed)
            s->value = outs[i];
    }
}

/* `name = other`: a second name for a value (e.g. `h = x` before a loop rebinds h). */
static int alias(kt__ktg_parser *p, int n_names, kt_value *out)
{
    if (n_names != 1)
        return kt__ktg_error(p, p->tok.at, "a plain name gives one value, expected one name "
                             "before '='");
    return kt__ktg_value_ref(p, out, NULL, NULL) && kt__ktg_end_of_statement(p);
}

/* The right-hand side: an op call (or a plain name); outs receives the values. */
static int rhs(kt__ktg_parser *p, const char (*names)[KT__KTG_NAME_MAX + 1],
               const kt__ktg_span *spans, int n_names, kt_value *outs)
{
    if (!kt__ktg_expect(p, KT__KTG_EQ, "'=' and an op call"))
        return 0;
    if (p->tok.kind == KT__KTG_IDENT) {
        kt__ktg_kind next = kt__ktg_peek(p).kind;
        if (next == KT__KTG_NEWLINE || next == KT__KTG_EOF || next == KT__KTG_LBRACE ||
            next == KT__KTG_TAIL)
            return alias(p, n_names, outs);
    }
    kt__ktg_span op_at = p->tok.at;
    kt_op op;
    kt_value in[KT_OP_MAX_IN];
    int n_in;
    kt_op_attrs attrs;
    memset(&attrs, 0, sizeof attrs);
    if (!lookup_op(p, &op))
        return 0;
    /* PyTorch's default: a zeroed struct would ignore class 0, which no model wants
     * silently */
    if (op == KT_OP_CROSS_ENTROPY)
        attrs.ignore_index = -100;
    if (!arguments(p, op, in, &n_in, &attrs) || !kt__ktg_end_of_statement(p))
        return 0;
    int min_in, max_in, n_out;
    if (kt_op_arity(op, &min_in, &max_in, &n_out) != KT_OK)
        return kt__ktg_graph_error(p, op_at);
    if (n_in < min_in || n_in > max_in) {
        if (min_in == max_in)
            return kt__ktg_error(p, op_at, "'%s' given %d value%s, expected %d", kt_op_name(op),
                                 n_in, n_in == 1 ? "" : "s", min_in);
        return kt__ktg_error(p, op_at, "'%s' given %d value%s, expected %d to %d",
                             kt_op_name(op), n_in, n_in == 1 ? "" : "s", min_in, max_in);
    }
    if (n_names != n_out) {
        kt__ktg_span all = spans[0];
        all.len = spans[n_names - 1].off + spans[n_names - 1].len - spans[0].off;
        return kt__ktg_error(p, all, "'%s' has %d output%s, expected %d name%s before '='",
                             kt_op_name(op), n_out, n_out == 1 ? "" : "s", n_out,
                             n_out == 1 ? "" : "s");
    }
    if (kt_graph_op(p->g, names[0], op, &attrs, in, n_in, outs) != KT_OK)
        return kt__ktg_graph_error(p, op_at);
    return 1;
}

void kt__ktg_assign(kt__ktg_parser *p)
{
    char names[2][KT__KTG_NAME_MAX + 1];
    kt__ktg_span spans[2];
    int n_names = 1;
    if (!kt__ktg_name(p, names[0], &spans[0]) || !check_target(p, names[0], spans[0]))
        return;
    if (p->tok.kind == KT__KTG_COMMA) {
        kt__ktg_advance(p);
        if (!kt__ktg_name(p, names[1], &spans[1]) || !check_target(p, names[1], spans[1])) {
            bind_names(p, names, spans, 1, NULL, 1);
            return;
        }
        n_names = 2;
    }
    kt_value outs[KT_OP_MAX_OUT];
    int ok = rhs(p, (const char (*)[KT__KTG_NAME_MAX + 1])names, spans, n_names, outs);
    bind_names(p, names, spans, n_names, outs, !ok);
}
