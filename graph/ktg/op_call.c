/* Op calls: NAME [, NAME] = op(values, attr = value, ...). The op is looked up by its name
 * in the op table, and its attributes by the list in its table entry (ops/attrs.h: names,
 * types, defaults, ranges; the generated table in docs/ktg.md); the builder then checks
 * shapes and dtypes. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "graph/ktg/ktg_internal.h"
#include "lib/ops/attrs.h"

static int unknown_attr(kt__ktg_parser *p, kt_op op, const char *word, kt__ktg_span at)
{
    int n;
    const kt__attr_desc *list = kt__attrs_of(op, &n);
    const char *names[32];
    for (int i = 0; i < n && i < 32; i++)
        names[i] = list[i].name;
    char allowed[160];
    kt__attr_names_text(op, allowed, sizeof allowed);
    if (n == 0)
        return kt__ktg_error(p, at, "unknown attribute '%s' ('%s' takes no attributes), "
                             "expected only values", word, kt_op_name(op));
    const char *near = kt__ktg_suggest(word, names, n < 32 ? n : 32);
    if (near != NULL)
        return kt__ktg_error(p, at, "unknown attribute '%s' for '%s' (did you mean '%s'?), "
                             "expected %s", word, kt_op_name(op), near, allowed);
    return kt__ktg_error(p, at, "unknown attribute '%s' for '%s', expected %s", word,
                         kt_op_name(op), allowed);
}

/* An integer expression in the attribute's range. */
static int int_value(kt__ktg_parser *p, const kt__attr_desc *d, int64_t *v)
{
    kt__ktg_span start = p->tok.at;
    if (!kt__ktg_expr(p, v))
        return 0;
    if (!kt__attr_in_range_i(d, *v)) {
        char range[160];
        kt__attr_range_text(d, range, sizeof range);
        return kt__ktg_error(p, kt__ktg_span_to_here(p, start), "%s = %lld, expected %s",
                             d->name, (long long)*v, range);
    }
    return 1;
}

static int float_value(kt__ktg_parser *p, const kt__attr_desc *d, double *f)
{
    kt__ktg_span start = p->tok.at;
    if (!kt__ktg_number(p, f))
        return 0;
    if (!kt__attr_in_range_f(d, *f)) {
        char range[160];
        kt__attr_range_text(d, range, sizeof range);
        return kt__ktg_error(p, kt__ktg_span_to_here(p, start), "%s = %g, expected %s",
                             d->name, *f, range);
    }
    return 1;
}

/* A word naming one of an enum attribute's values (its index). */
static int word_value(kt__ktg_parser *p, kt_op op, const kt__attr_desc *d, int64_t *index)
{
    char expected[160], what[96];
    kt__attr_range_text(d, expected, sizeof expected);
    snprintf(what, sizeof what, "%s %s", kt_op_name(op), d->name);
    if (p->tok.kind != KT__KTG_IDENT)
        return kt__ktg_expected(p, expected);
    char word[64];
    kt__ktg_text(p, &p->tok, word, sizeof word);
    for (int i = 0; i < d->n_values; i++)
        if (p->tok.at.len == strlen(d->values[i]) && strcmp(word, d->values[i]) == 0) {
            *index = i;
            kt__ktg_advance(p);
            return 1;
        }
    const char *near = kt__ktg_suggest(word, d->values, d->n_values);
    if (near != NULL)
        return kt__ktg_error(p, p->tok.at, "unknown %s '%s' (did you mean '%s'?), expected %s",
                             what, word, near, expected);
    return kt__ktg_error(p, p->tok.at, "unknown %s '%s', expected %s", what, word, expected);
}

/* A bracketed shape list, each entry in range (reshape's -1 at most once is its own check). */
static int shape_value(kt__ktg_parser *p, const kt__attr_desc *d, kt_op_attrs *attrs)
{
    int64_t dims[KT_MAX_DIMS];
    int ndim;
    kt__ktg_span start = p->tok.at;
    if (!kt__ktg_dims(p, dims, &ndim, 0))
        return 0;
    for (int k = 0; k < ndim; k++)
        if (!kt__attr_in_range_i(d, dims[k])) {
            char range[160];
            kt__attr_range_text(d, range, sizeof range);
            return kt__ktg_error(p, kt__ktg_span_to_here(p, start), "%s entry %d = %lld, "
                                 "expected %s", d->name, k, (long long)dims[k], range);
        }
    kt__attr_set_shape(d, attrs, dims, ndim);
    return 1;
}

/* IDENT "=" value, with the current token at IDENT. The op's table entry says which names
 * it takes, their types and ranges; this function knows no op. */
static int attribute(kt__ktg_parser *p, kt_op op, kt_op_attrs *attrs, unsigned *given)
{
    kt__ktg_token t = p->tok;
    char word[64];
    kt__ktg_text(p, &t, word, sizeof word);
    int n;
    const kt__attr_desc *list = kt__attrs_of(op, &n);
    const kt__attr_desc *d =
        t.at.len < sizeof word ? kt__attr_find(op, word, t.at.len) : NULL;
    if (d == NULL)
        return unknown_attr(p, op, word, t.at);
    const unsigned bit = 1u << (unsigned)(d - list);
    if (*given & bit)
        return kt__ktg_error(p, t.at, "attribute '%s' given twice, expected each attribute "
                             "once", word);
    *given |= bit;
    kt__ktg_advance(p);
    kt__ktg_advance(p); /* the '=' (checked by the caller's look-ahead) */
    int64_t v;
    double f;
    switch (d->type) {
    case KT__ATTR_FLOAT:
        if (!float_value(p, d, &f))
            return 0;
        kt__attr_set_f(d, attrs, f);
        return 1;
    case KT__ATTR_ENUM:
        if (!word_value(p, op, d, &v))
            return 0;
        kt__attr_set_i(d, attrs, v);
        return 1;
    case KT__ATTR_SHAPE:
        return shape_value(p, d, attrs);
    default:
        if (!int_value(p, d, &v))
            return 0;
        kt__attr_set_i(d, attrs, v);
        return 1;
    }
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
    int n;
    const kt__attr_desc *list = kt__attrs_of(op, &n);
    for (int i = 0; i < n; i++)
        if (list[i].required && !(given & (1u << i)))
            return kt__ktg_error(p, at, "'%s' needs %s, expected %s = value", kt_op_name(op),
                                 list[i].name, list[i].name);
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
    return kt__ktg_not_hidden(p, name, at);
}

/* Binds each name to its value, or (failed, or poisoned by a failed name it uses) to a broken
 * marker that silences later uses. */
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
    return kt__ktg_value_ref(p, out, NULL, NULL) && kt__ktg_end_of_statement(p) &&
           !p->poisoned;
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
    if (!lookup_op(p, &op))
        return 0;
    kt_op_attrs attrs = kt_op_defaults(op); /* the table's defaults, the same as through C */
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
    if (p->poisoned)
        return 0; /* checked for its own mistakes; a value it uses does not exist */
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
