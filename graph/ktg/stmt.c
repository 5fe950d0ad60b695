/* The declaration and annotation statements: const, input, param, output, loss, policy,
 * shard. Each starts at its keyword (the current token) and stops at the end of the
 * statement or at its first error (the caller then skips the rest of the statement). */
#include <stdio.h>
#include <string.h>

#include "graph/ktg/ktg_internal.h"

static const unsigned tensor_kinds = 1u << KT__KTG_SYM_LEAF | 1u << KT__KTG_SYM_VALUE;

/* A new name must not be bound already: constants and leaves are defined once. */
static int check_new(kt__ktg_parser *p, const char *name, kt__ktg_span at)
{
    const kt__ktg_sym *s = kt__ktg_sym_find(&p->syms, name);
    if (s == NULL || s->kind == KT__KTG_SYM_NONE)
        return 1;
    static const char *const what[] = {"", "a constant", "a loop variable", "a tensor",
                                       "a tensor", "a tensor"}; /* by kt__ktg_sym_kind */
    return kt__ktg_error(p, at, "redefinition of '%s' (%s defined at line %d, column %d), "
                         "expected a new name", name, what[s->kind], s->line, s->col);
}

static kt__ktg_sym *bind(kt__ktg_parser *p, const char *name, kt__ktg_span at)
{
    kt__ktg_sym *s = kt__ktg_sym_get(&p->syms, name);
    if (s == NULL) {
        kt__ktg_error(p, at, "out of memory for names, expected a smaller model");
        return NULL;
    }
    s->line = at.line;
    s->col = at.col;
    s->is_input = 0;
    return s;
}

int kt__ktg_value_ref(kt__ktg_parser *p, kt_value *value_out, char *name_out,
                     kt__ktg_span *span_out)
{
    char name[KT__KTG_NAME_MAX + 1];
    kt__ktg_span at;
    if (!kt__ktg_name(p, name, &at))
        return 0;
    const kt__ktg_sym *s = kt__ktg_resolve(p, name, name); /* in a scope, its names first */
    if (name_out)
        memcpy(name_out, name, sizeof name);
    if (span_out)
        *span_out = at;
    if (s != NULL && (s->kind == KT__KTG_SYM_LEAF || s->kind == KT__KTG_SYM_VALUE)) {
        *value_out = s->value;
        return 1;
    }
    if (s != NULL && s->kind == KT__KTG_SYM_BROKEN) {
        /* the statement that bound it has been reported: no cascade, but the rest of this
         * statement is still checked (a missing ')' after it is an error of its own) */
        p->poisoned = 1;
        value_out->id = -1;
        return 1;
    }
    if (s != NULL)
        return kt__ktg_error(p, at, "'%s' is an integer %s, expected a tensor", name,
                             s->kind == KT__KTG_SYM_CONST ? "constant" : "loop variable");
    if (kt__ktg_reported(p, at))
        return kt__ktg_error(p, at, "-");
    const char *near = kt__ktg_suggest_symbol(p, name, tensor_kinds);
    if (near != NULL)
        return kt__ktg_error(p, at, "'%s' is not defined (did you mean '%s'?)", name, near);
    return kt__ktg_error(p, at, "'%s' is not defined", name);
}

void kt__ktg_stmt_const(kt__ktg_parser *p, int top_level)
{
    kt__ktg_span kw = p->tok.at;
    if (!top_level) {
        kt__ktg_error(p, kw, "'const' inside a block, expected constants at the top level");
        return;
    }
    kt__ktg_advance(p);
    if (p->tok.kind != KT__KTG_IDENT) {
        kt__ktg_expected(p, "the constant's name");
        return;
    }
    char name[KT__KTG_NAME_MAX + 1];
    kt__ktg_token t = p->tok;
    kt__ktg_text(p, &t, name, sizeof name);
    if (t.at.len > KT__KTG_NAME_MAX) {
        kt__ktg_error(p, t.at, "name too long, expected at most %d bytes", KT__KTG_NAME_MAX);
        return;
    }
    /* a -D override is used even when the statement has an error, so it is not reported as
     * naming no constant */
    int override = -1;
    for (int i = 0; i < p->n_defines; i++)
        if (strcmp(p->defines[i].name, name) == 0) {
            override = i; /* the last one wins, as with repeated -D on a command line */
            p->define_used[i] = 1;
        }
    if (!check_new(p, name, t.at))
        return;
    kt__ktg_advance(p);
    int64_t v;
    if (!kt__ktg_expect(p, KT__KTG_EQ, "'=' and the constant's value") || !kt__ktg_expr(p, &v) ||
        !kt__ktg_end_of_statement(p))
        return;
    kt__ktg_sym *s = bind(p, name, t.at);
    if (s == NULL)
        return;
    s->kind = KT__KTG_SYM_CONST;
    s->ival = override >= 0 ? p->defines[override].value : v;
}

static int parse_dtype(kt__ktg_parser *p, kt_dtype *dtype_out)
{
    static const char *const names[] = {"f32", "bf16", "f16", "i32", "i64"};
    static const kt_dtype dtypes[] = {KT_F32, KT_BF16, KT_F16, KT_I32, KT_I64};
    if (p->tok.kind != KT__KTG_IDENT)
        return kt__ktg_expected(p, "a dtype (f32, bf16, f16, i32 or i64)");
    char word[64];
    kt__ktg_text(p, &p->tok, word, sizeof word);
    for (int i = 0; i < 5; i++)
        if (strcmp(word, names[i]) == 0 && p->tok.at.len == strlen(names[i])) {
            *dtype_out = dtypes[i];
            kt__ktg_advance(p);
            return 1;
        }
    const char *near = kt__ktg_suggest(word, names, 5);
    if (near != NULL)
        return kt__ktg_error(p, p->tok.at, "unknown dtype '%s' (did you mean '%s'?), expected "
                             "f32, bf16, f16, i32 or i64", word, near);
    return kt__ktg_error(p, p->tok.at, "unknown dtype '%s', expected f32, bf16, f16, i32 or "
                         "i64", word);
}

/* ":" dtype "[" dims "]", after a declaration's name */
static int parse_type(kt__ktg_parser *p, kt_dtype *dtype, int64_t *dims, int *ndim)
{
    return kt__ktg_expect(p, KT__KTG_COLON, "':' and the type") && parse_dtype(p, dtype) &&
           kt__ktg_dims(p, dims, ndim, 1);
}

/* A declaration that failed after its name was read binds the name as broken, so that its
 * uses are not reported again: one mistake, one error. */
static void bind_broken(kt__ktg_parser *p, const char *name, kt__ktg_span at)
{
    kt__ktg_sym *s = bind(p, name, at);
    if (s != NULL)
        s->kind = KT__KTG_SYM_BROKEN;
}

/* "ALIAS =" before a declaration's name (a plain name and '='; the declared name is
 * followed by ':'). alias[0] is '\0' when there is none. */
static int parse_alias(kt__ktg_parser *p, char *alias, kt__ktg_span *at)
{
    alias[0] = '\0';
    if (p->tok.kind != KT__KTG_IDENT || kt__ktg_peek(p).kind != KT__KTG_EQ)
        return 1;
    *at = p->tok.at;
    if (p->tok.at.len > KT__KTG_NAME_MAX)
        return kt__ktg_error(p, *at, "name too long, expected at most %d bytes",
                             KT__KTG_NAME_MAX);
    kt__ktg_text(p, &p->tok, alias, KT__KTG_NAME_MAX + 1);
    const kt__ktg_sym *s = kt__ktg_sym_find(&p->syms, alias);
    if (s != NULL && (s->kind == KT__KTG_SYM_CONST || s->kind == KT__KTG_SYM_LOOPVAR))
        return kt__ktg_error(p, *at, "'%s' is an integer %s (line %d), expected a new name for "
                             "the alias", alias, s->kind == KT__KTG_SYM_CONST ? "constant"
                                                                               : "loop variable",
                             s->line);
    if (s != NULL && s->kind == KT__KTG_SYM_LEAF)
        return kt__ktg_error(p, *at, "'%s' is the name of an input or parameter (line %d, "
                             "column %d), expected another name for the alias", alias, s->line,
                             s->col);
    if (!kt__ktg_not_hidden(p, alias, *at))
        return 0;
    kt__ktg_advance(p);
    kt__ktg_advance(p); /* the '=' */
    return 1;
}

/* The declared name after the alias; refuses "param w = w" (an alias that hides nothing)
 * and explains a '=' after an interpolated name. */
static int decl_name(kt__ktg_parser *p, const char *alias, kt__ktg_span alias_at, char *name,
                     kt__ktg_span *at)
{
    if (!kt__ktg_decl_name(p, name, at) || !check_new(p, name, *at))
        return 0;
    if (alias[0] != '\0' && strcmp(alias, name) == 0)
        return kt__ktg_error(p, alias_at, "the alias '%s' is the declared name itself, "
                             "expected another name or no alias", alias);
    if (p->tok.kind == KT__KTG_EQ)
        return kt__ktg_error(p, p->tok.at, "unexpected '=' after the name (an alias, as in "
                             "'param w = model.w: ...', is a plain name without {expr}), "
                             "expected ':' and the type");
    return 1;
}

/* Binds the declaration's alias to its tensor, or as broken when the declaration failed. */
static void bind_alias(kt__ktg_parser *p, const char *alias, kt__ktg_span at, const kt_value *v,
                       int is_input)
{
    if (alias[0] == '\0')
        return;
    kt__ktg_sym *s = bind(p, alias, at);
    if (s == NULL)
        return;
    s->kind = v != NULL ? KT__KTG_SYM_VALUE : KT__KTG_SYM_BROKEN;
    if (v != NULL) {
        s->value = *v;
        s->is_input = is_input;
    }
}

void kt__ktg_stmt_input(kt__ktg_parser *p)
{
    kt__ktg_span kw = p->tok.at, at;
    kt__ktg_advance(p);
    char name[KT__KTG_NAME_MAX + 1], alias[KT__KTG_NAME_MAX + 1];
    kt__ktg_span alias_at = kw;
    kt_dtype dtype = KT_F32;
    int64_t dims[KT_MAX_DIMS];
    int ndim;
    if (!parse_alias(p, alias, &alias_at))
        return;
    if (!decl_name(p, alias, alias_at, name, &at)) {
        bind_alias(p, alias, alias_at, NULL, 1);
        return;
    }
    kt_value v;
    if (!parse_type(p, &dtype, dims, &ndim) || !kt__ktg_end_of_statement(p)) {
        bind_broken(p, name, at);
        bind_alias(p, alias, alias_at, NULL, 1);
        return;
    }
    if (kt_graph_input(p->g, name, dtype, ndim, dims, &v) != KT_OK) {
        kt__ktg_graph_error(p, kw);
        bind_broken(p, name, at);
        bind_alias(p, alias, alias_at, NULL, 1);
        return;
    }
    kt__ktg_sym *s = bind(p, name, at);
    if (s != NULL) {
        s->kind = KT__KTG_SYM_LEAF;
        s->value = v;
        s->is_input = 1;
    }
    bind_alias(p, alias, alias_at, &v, 1);
}

static int parse_init(kt__ktg_parser *p, kt_init *init)
{
    static const char *const names[] = {"zeros", "ones", "normal", "uniform", "loaded"};
    const char *expected = "zeros, ones, normal(std), uniform(lo, hi) or loaded";
    if (p->tok.kind != KT__KTG_IDENT)
        return kt__ktg_expected(p, expected);
    char word[64];
    kt__ktg_token t = p->tok;
    kt__ktg_text(p, &t, word, sizeof word);
    int kind = -1;
    for (int i = 0; i < 5; i++)
        if (t.at.len == strlen(names[i]) && strcmp(word, names[i]) == 0)
            kind = i;
    if (kind < 0) {
        const char *near = kt__ktg_suggest(word, names, 5);
        if (near != NULL)
            return kt__ktg_error(p, t.at, "unknown initialiser '%s' (did you mean '%s'?), "
                                 "expected %s", word, near, expected);
        return kt__ktg_error(p, t.at, "unknown initialiser '%s', expected %s", word, expected);
    }
    kt__ktg_advance(p);
    static const kt_init_kind kinds[] = {KT_INIT_ZEROS, KT_INIT_ONES, KT_INIT_NORMAL,
                                         KT_INIT_UNIFORM, KT_INIT_LOADED};
    *init = (kt_init){kinds[kind], 0.0f, 0.0f};
    if (kinds[kind] != KT_INIT_NORMAL && kinds[kind] != KT_INIT_UNIFORM)
        return 1;
    double a, b = 0.0;
    if (!kt__ktg_expect(p, KT__KTG_LPAREN, kind == 2 ? "'(' and the standard deviation"
                                                     : "'(' and the bounds lo, hi") ||
        !kt__ktg_number(p, &a))
        return 0;
    if (kinds[kind] == KT_INIT_UNIFORM &&
        (!kt__ktg_expect(p, KT__KTG_COMMA, "',' and the upper bound") || !kt__ktg_number(p, &b)))
        return 0;
    if (!kt__ktg_expect(p, KT__KTG_RPAREN, "')'"))
        return 0;
    kt__ktg_span span = kt__ktg_span_to_here(p, t.at);
    if (kinds[kind] == KT_INIT_NORMAL && !(a >= 0))
        return kt__ktg_error(p, span, "normal(%g): a negative standard deviation, expected "
                             "std >= 0", a);
    if (kinds[kind] == KT_INIT_UNIFORM && !(a < b))
        return kt__ktg_error(p, span, "uniform(%g, %g): an empty range, expected lo < hi", a,
                             b);
    init->a = (float)a;
    init->b = (float)b;
    return 1;
}

void kt__ktg_stmt_param(kt__ktg_parser *p)
{
    kt__ktg_span kw = p->tok.at, at;
    kt__ktg_advance(p);
    int frozen = 0;
    kt__ktg_kind next = kt__ktg_peek(p).kind;
    if (kt__ktg_is_word(p, &p->tok, "frozen") && next != KT__KTG_COLON && next != KT__KTG_EQ) {
        frozen = 1; /* "param frozen: ..." is a parameter named frozen, "frozen = " an alias */
        kt__ktg_advance(p);
    }
    char name[KT__KTG_NAME_MAX + 1], alias[KT__KTG_NAME_MAX + 1];
    kt__ktg_span alias_at = kw;
    kt_dtype dtype = KT_F32;
    int64_t dims[KT_MAX_DIMS];
    int ndim;
    kt_init init;
    if (!parse_alias(p, alias, &alias_at))
        return;
    if (!decl_name(p, alias, alias_at, name, &at)) {
        bind_alias(p, alias, alias_at, NULL, 0);
        return;
    }
    if (!parse_type(p, &dtype, dims, &ndim) ||
        !kt__ktg_expect(p, KT__KTG_EQ, "'=' and an initialiser") || !parse_init(p, &init) ||
        !kt__ktg_end_of_statement(p)) {
        bind_broken(p, name, at);
        bind_alias(p, alias, alias_at, NULL, 0);
        return;
    }
    kt_value v;
    kt_status st = frozen ? kt_graph_const_param(p->g, name, dtype, ndim, dims, init, &v)
                          : kt_graph_param(p->g, name, dtype, ndim, dims, init, &v);
    if (st != KT_OK) {
        kt__ktg_graph_error(p, kw);
        bind_broken(p, name, at);
        bind_alias(p, alias, alias_at, NULL, 0);
        return;
    }
    kt__ktg_sym *s = bind(p, name, at);
    if (s != NULL) {
        s->kind = KT__KTG_SYM_LEAF;
        s->value = v;
    }
    bind_alias(p, alias, alias_at, &v, 0);
}

void kt__ktg_stmt_output(kt__ktg_parser *p)
{
    kt__ktg_span kw = p->tok.at;
    kt__ktg_advance(p);
    kt_value v;
    char name[KT__KTG_NAME_MAX + 1];
    if (!kt__ktg_value_ref(p, &v, name, NULL))
        return;
    if (kt__ktg_is_word(p, &p->tok, "as")) {
        kt__ktg_advance(p);
        if (!kt__ktg_name(p, name, NULL))
            return;
    }
    if (!kt__ktg_end_of_statement(p) || p->poisoned)
        return;
    if (kt_graph_output(p->g, v, name) != KT_OK)
        kt__ktg_graph_error(p, kw);
}

void kt__ktg_stmt_loss(kt__ktg_parser *p)
{
    kt__ktg_span kw = p->tok.at;
    kt__ktg_advance(p);
    kt_value v;
    if (!kt__ktg_value_ref(p, &v, NULL, NULL) || !kt__ktg_end_of_statement(p) ||
        p->poisoned)
        return;
    if (kt_graph_set_loss(p->g, v) != KT_OK)
        kt__ktg_graph_error(p, kw);
}
