/* kt_ktg_parse: the statement loop, blocks (repeat, checkpoint), error recovery and the
 * result. See ktg_internal.h for how the parser is bounded. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "graph/ktg/ktg_internal.h"

static void statement(kt__ktg_parser *p, int depth);

/* Error recovery: skips to the end of the statement. Braces are counted so that a bad
 * block header skips its whole body; a '}' that starts a line and closes an enclosing block
 * is left for that block. */
static void skip_statement(kt__ktg_parser *p)
{
    int64_t depth = 0;
    while (p->tok.kind != KT__KTG_EOF) {
        kt__ktg_kind k = p->tok.kind;
        if (k == KT__KTG_NEWLINE && depth <= 0)
            return;
        if (k == KT__KTG_RBRACE && depth <= 0 && p->tok.first)
            return;
        if (k == KT__KTG_LBRACE)
            depth++;
        else if (k == KT__KTG_RBRACE)
            depth--;
        kt__ktg_advance(p);
    }
}

static void unterminated(kt__ktg_parser *p, kt__ktg_span open, const char *what)
{
    kt__ktg_error(p, open, "unterminated '%s' block (line %d), expected '}' before the end of "
                  "the file", what, open.line);
}

/* Skips a block unread (an empty repeat range, or one nested too deeply), the current
 * token being its '{'; consumes the matching '}'. */
static void skip_block(kt__ktg_parser *p, kt__ktg_span open, const char *what)
{
    int64_t depth = 0;
    do {
        if (p->tok.kind == KT__KTG_EOF) {
            unterminated(p, open, what);
            return;
        }
        if (p->tok.kind == KT__KTG_LBRACE)
            depth++;
        else if (p->tok.kind == KT__KTG_RBRACE)
            depth--;
        kt__ktg_advance(p);
    } while (depth > 0);
}

/* The statements of a block up to its '}' (consumed); the current token is just past the
 * '{'. Returns 0 at the end of the file (reported) or when the parser stopped. */
static int block_body(kt__ktg_parser *p, int depth, kt__ktg_span open, const char *what)
{
    for (;;) {
        while (p->tok.kind == KT__KTG_NEWLINE)
            kt__ktg_advance(p);
        if (p->stop)
            return 0;
        if (p->tok.kind == KT__KTG_EOF) {
            unterminated(p, open, what);
            return 0;
        }
        if (p->tok.kind == KT__KTG_RBRACE) {
            kt__ktg_advance(p);
            return 1;
        }
        statement(p, depth);
    }
}

static int open_block(kt__ktg_parser *p, int depth, const char *what)
{
    if (p->tok.kind != KT__KTG_LBRACE) {
        char expected[64];
        snprintf(expected, sizeof expected, "'{' to open the '%s' body", what);
        return kt__ktg_expected(p, expected);
    }
    if (depth >= KT__KTG_MAX_BLOCK_DEPTH) {
        kt__ktg_span open = p->tok.at;
        kt__ktg_error(p, open, "blocks nested too deeply, expected at most %d levels",
                      KT__KTG_MAX_BLOCK_DEPTH);
        skip_block(p, open, what);
        return 0;
    }
    return 1;
}

/* repeat VAR in FROM..TO { body }: the body is re-read once per value of VAR. */
static void stmt_repeat(kt__ktg_parser *p, int depth)
{
    kt__ktg_advance(p);
    if (p->tok.kind != KT__KTG_IDENT) {
        kt__ktg_expected(p, "the loop variable's name");
        return;
    }
    kt__ktg_token var = p->tok;
    char name[KT__KTG_NAME_MAX + 1];
    kt__ktg_text(p, &var, name, sizeof name);
    const kt__ktg_sym *old = kt__ktg_sym_find(&p->syms, name);
    if (var.at.len > KT__KTG_NAME_MAX) {
        kt__ktg_error(p, var.at, "name too long, expected at most %d bytes", KT__KTG_NAME_MAX);
        return;
    }
    if (old != NULL && old->kind != KT__KTG_SYM_NONE) {
        kt__ktg_error(p, var.at, "loop variable '%s' is already defined (line %d), expected a "
                      "new name", name, old->line);
        return;
    }
    kt__ktg_advance(p);
    if (!kt__ktg_is_word(p, &p->tok, "in")) {
        kt__ktg_expected(p, "'in' and the range from..to");
        return;
    }
    kt__ktg_advance(p);
    int64_t from, to;
    if (!kt__ktg_expr(p, &from) || !kt__ktg_expect(p, KT__KTG_DOTDOT, "'..' and the range's "
                                                   "end") ||
        !kt__ktg_expr(p, &to) || !open_block(p, depth, "repeat"))
        return;
    kt__ktg_span open = p->tok.at;
    if (from >= to) {
        skip_block(p, open, "repeat");
    } else {
        kt__ktg_lexer saved_lx = p->lx;
        kt__ktg_token saved_tok = p->tok;
        for (int64_t i = from; i < to && !p->stop; i++) {
            /* an empty body must still spend the budget, or 0..2^62 would spin */
            if (++p->n_statements > KT__KTG_MAX_STATEMENTS) {
                kt__ktg_error(p, open, "too many statements after expanding repeats, expected "
                              "at most %d", KT__KTG_MAX_STATEMENTS);
                p->stop = 1;
                break;
            }
            kt__ktg_sym *s = kt__ktg_sym_get(&p->syms, name);
            if (s == NULL) {
                kt__ktg_error(p, var.at, "out of memory for names, expected a smaller model");
                break;
            }
            s->kind = KT__KTG_SYM_LOOPVAR;
            s->ival = i;
            s->line = var.at.line;
            s->col = var.at.col;
            uint64_t n_tokens = p->lx.n_tokens; /* the budget spans iterations */
            p->lx = saved_lx;
            p->lx.n_tokens = n_tokens;
            p->tok = saved_tok;
            kt__ktg_advance(p);
            if (!block_body(p, depth + 1, open, "repeat"))
                break;
        }
        kt__ktg_sym *s = kt__ktg_sym_find(&p->syms, name);
        if (s != NULL)
            s->kind = KT__KTG_SYM_NONE;
    }
    p->failed = 0;
    kt__ktg_end_of_statement(p);
}

/* checkpoint { body }: the body's nodes form one recompute segment. */
static void stmt_checkpoint(kt__ktg_parser *p, int depth)
{
    kt__ktg_span kw = p->tok.at;
    kt__ktg_advance(p);
    if (!open_block(p, depth, "checkpoint"))
        return;
    kt__ktg_span open = p->tok.at;
    int began = kt_graph_checkpoint_begin(p->g) == KT_OK;
    if (!began)
        kt__ktg_graph_error(p, kw);
    kt__ktg_advance(p);
    int closed = block_body(p, depth + 1, open, "checkpoint");
    if (began && kt_graph_checkpoint_end(p->g) != KT_OK)
        kt__ktg_graph_error(p, kw);
    p->failed = 0;
    if (closed)
        kt__ktg_end_of_statement(p);
}

/* scope NAME { body }: params and inputs declared in the body are named NAME.<their name>,
 * and a name used in it is looked up under NAME first (kt__ktg_resolve). Nested scopes
 * join their names with '.'. */
static void stmt_scope(kt__ktg_parser *p, int depth)
{
    kt__ktg_advance(p);
    if (p->tok.kind != KT__KTG_IDENT) {
        kt__ktg_expected(p, "the scope's name (the prefix of the names declared in it)");
        return;
    }
    char name[KT__KTG_NAME_MAX + 1];
    kt__ktg_span at;
    if (!kt__ktg_name(p, name, &at) || !open_block(p, depth, "scope"))
        return;
    size_t outer = p->n_scopes > 0 ? p->scope_end[p->n_scopes - 1] : 0;
    size_t start = outer > 0 ? outer + 1 : 0, n = strlen(name);
    if (start + n + 2 > KT__KTG_NAME_MAX) { /* room for ".x" after it */
        kt__ktg_error(p, at, "scope name too long with the enclosing prefix '%.*s', expected "
                      "at most %d bytes in all", (int)outer, p->scope, KT__KTG_NAME_MAX - 2);
        return;
    }
    kt__ktg_span open = p->tok.at;
    if (outer > 0)
        p->scope[outer] = '.';
    memcpy(p->scope + start, name, n + 1);
    p->scope_end[p->n_scopes++] = start + n; /* open_block bounds the nesting: < 16 */
    kt__ktg_advance(p);
    int closed = block_body(p, depth + 1, open, "scope");
    p->n_scopes--;
    p->scope[outer] = '\0';
    p->failed = 0;
    if (closed)
        kt__ktg_end_of_statement(p);
}

static const char *const keywords[] = {"const",  "input",      "param",  "output", "loss",
                                       "repeat", "checkpoint", "policy", "shard",  "scope"};
enum { N_KEYWORDS = sizeof keywords / sizeof keywords[0] };

static void statement(kt__ktg_parser *p, int depth)
{
    p->failed = 0;
    p->poisoned = 0;
    if (++p->n_statements > KT__KTG_MAX_STATEMENTS) {
        kt__ktg_error(p, p->tok.at, "too many statements after expanding repeats, expected at "
                      "most %d", KT__KTG_MAX_STATEMENTS);
        p->stop = 1;
        return;
    }
    kt__ktg_token t = p->tok;
    if (t.kind == KT__KTG_RBRACE) {
        kt__ktg_error(p, t.at, "'}' with no open block, expected a statement");
        kt__ktg_advance(p);
        p->failed = 0; /* the '}' is consumed: no more to skip */
    } else if (t.kind != KT__KTG_IDENT) {
        kt__ktg_expected(p, "a statement");
    } else {
        kt__ktg_token next = kt__ktg_peek(p);
        int word = -1;
        for (int i = 0; i < N_KEYWORDS; i++)
            if (kt__ktg_is_word(p, &t, keywords[i]))
                word = i;
        int assign = next.kind == KT__KTG_EQ || next.kind == KT__KTG_COMMA ||
                     (next.kind == KT__KTG_LBRACE && next.adjacent);
        if (word == 6 && next.kind == KT__KTG_LBRACE)
            assign = 0; /* "checkpoint{" opens a block */
        if (word >= 0 && !assign) {
            switch (word) {
            case 0: kt__ktg_stmt_const(p, depth == 0); break;
            case 1: kt__ktg_stmt_input(p); break;
            case 2: kt__ktg_stmt_param(p); break;
            case 3: kt__ktg_stmt_output(p); break;
            case 4: kt__ktg_stmt_loss(p); break;
            case 5: stmt_repeat(p, depth); break;
            case 6: stmt_checkpoint(p, depth); break;
            case 7: kt__ktg_stmt_policy(p); break;
            case 8: kt__ktg_stmt_shard(p); break;
            default: stmt_scope(p, depth); break;
            }
        } else if (assign) {
            kt__ktg_assign(p);
        } else {
            char text[64];
            kt__ktg_text(p, &t, text, sizeof text);
            const char *near = kt__ktg_suggest(text, keywords, N_KEYWORDS);
            if (near != NULL)
                kt__ktg_error(p, t.at, "unknown statement '%s' (did you mean '%s'?), expected "
                              "a statement", text, near);
            else
                kt__ktg_error(p, t.at, "unknown statement '%s', expected a keyword (const, "
                              "input, param, output, loss, repeat, checkpoint, policy, "
                              "shard, scope) or NAME = op(...)", text);
        }
    }
    if (p->failed)
        skip_statement(p);
}

/* -D overrides that named no constant of the file. */
static void check_defines(kt__ktg_parser *p)
{
    for (int i = 0; i < p->n_defines; i++) {
        if (p->define_used[i])
            continue;
        const char *name = p->defines[i].name != NULL ? p->defines[i].name : "(null)";
        char msg[320];
        const char *near = kt__ktg_suggest_symbol(p, name, 1u << KT__KTG_SYM_CONST);
        if (near != NULL)
            snprintf(msg, sizeof msg, "-D %.64s=%lld names no constant of the file (did you "
                     "mean '%s'?), expected the name of a 'const'", name,
                     (long long)p->defines[i].value, near);
        else
            snprintf(msg, sizeof msg, "-D %.64s=%lld names no constant of the file, expected "
                     "the name of a 'const'", name, (long long)p->defines[i].value);
        kt__ktg_diag_plain(&p->diag, msg);
    }
}

kt_status kt_ktg_parse(const char *text, size_t len, const char *filename,
                       const kt_ktg_define *defines, int n_defines, kt_graph **graph_out,
                       char *diag, size_t diag_size, int *n_errors_out)
{
    if (graph_out != NULL)
        *graph_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    if (diag != NULL && diag_size > 0)
        diag[0] = '\0';
    if (n_errors_out != NULL)
        *n_errors_out = 0;
    if (graph_out == NULL || (text == NULL && len > 0) || n_defines < 0 ||
        (defines == NULL && n_defines > 0))
        return kt__error(KT_EINVAL, "kt_ktg_parse: NULL or negative argument");
    *graph_out = NULL;
    kt__ktg_parser *p = calloc(1, sizeof *p);
    if (p == NULL)
        return kt__error(KT_ENOMEM, "kt_ktg_parse: out of memory");
    if (n_defines > 0 && (p->define_used = calloc((size_t)n_defines, 1)) == NULL) {
        free(p);
        return kt__error(KT_ENOMEM, "kt_ktg_parse: out of memory");
    }
    kt_status st = kt_graph_create(&p->g);
    if (st != KT_OK) {
        free(p->define_used);
        free(p);
        return st;
    }
    p->defines = defines;
    p->n_defines = n_defines;
    p->diag.src = text != NULL ? text : "";
    p->diag.src_len = len;
    p->diag.filename = filename != NULL ? filename : "<input>";
    p->diag.buf = diag;
    p->diag.size = diag_size;
    kt__ktg_lex_init(&p->lx, p->diag.src, len);
    /* matching a NULL define name would crash strcmp: give it a name no const can have */
    static const kt_ktg_define none = {"", 0};
    kt_ktg_define *safe = NULL;
    if (n_defines > 0) {
        safe = malloc((size_t)n_defines * sizeof *safe);
        if (safe == NULL) {
            kt_graph_destroy(p->g);
            free(p->define_used);
            free(p);
            return kt__error(KT_ENOMEM, "kt_ktg_parse: out of memory");
        }
        for (int i = 0; i < n_defines; i++)
            safe[i] = defines[i].name != NULL ? defines[i] : none;
        p->defines = safe;
    }

    kt__ktg_advance(p);
    while (p->tok.kind != KT__KTG_EOF && !p->stop) {
        if (p->tok.kind == KT__KTG_NEWLINE)
            kt__ktg_advance(p);
        else
            statement(p, 0);
    }
    p->defines = defines;
    if (!p->stop)
        check_defines(p);

    int n_errors = p->diag.n_errors;
    if (n_errors_out != NULL)
        *n_errors_out = n_errors;
    if (n_errors == 0) {
        *graph_out = p->g;
        st = KT_OK;
    } else {
        kt_graph_destroy(p->g);
        st = kt__error(p->diag.n_graph_errors == n_errors ? KT_EINVAL : KT_EFORMAT, "%s",
                       p->diag.first);
    }
    kt__ktg_sym_free(&p->syms);
    free(safe);
    free(p->define_used);
    free(p);
    return st;
}
