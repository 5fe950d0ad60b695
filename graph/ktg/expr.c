/* Integer expressions, names with {expr} parts, numbers and dimension lists.
 *
 * Expressions are evaluated while they are parsed, in int64 with every overflow and every
 * division by zero reported (they size tensors: a wrapped value would be a wrong shape). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/ktg/ktg_internal.h"

static int unary(kt__ktg_parser *p, int64_t *v);

static int parse_int_literal(kt__ktg_parser *p, int64_t *v)
{
    int64_t r = 0;
    for (size_t i = 0; i < p->tok.at.len; i++) {
        int d = p->lx.src[p->tok.at.off + i] - '0';
        if (r > (INT64_MAX - d) / 10)
            return kt__ktg_error(p, p->tok.at, "integer too large, expected at most %lld",
                                 (long long)INT64_MAX);
        r = r * 10 + d;
    }
    *v = r;
    kt__ktg_advance(p);
    return 1;
}

static int atom(kt__ktg_parser *p, int64_t *v)
{
    kt__ktg_token t = p->tok;
    if (t.kind == KT__KTG_INT)
        return parse_int_literal(p, v);
    if (t.kind == KT__KTG_LPAREN) {
        kt__ktg_advance(p);
        if (!kt__ktg_expr(p, v))
            return 0;
        return kt__ktg_expect(p, KT__KTG_RPAREN, "')' to close the '('");
    }
    if (t.kind == KT__KTG_FLOAT)
        return kt__ktg_error(p, t.at, "a float in an integer expression, expected an "
                             "integer");
    if (t.kind != KT__KTG_IDENT)
        return kt__ktg_expected(p, "an integer, a constant or '('");
    char name[KT__KTG_NAME_MAX + 1];
    kt__ktg_text(p, &t, name, sizeof name);
    kt__ktg_sym *s = kt__ktg_sym_find(&p->syms, name);
    if (s != NULL && (s->kind == KT__KTG_SYM_CONST || s->kind == KT__KTG_SYM_LOOPVAR)) {
        *v = s->ival;
        kt__ktg_advance(p);
        return 1;
    }
    if (s != NULL && s->kind != KT__KTG_SYM_NONE)
        return kt__ktg_error(p, t.at, "'%s' is a tensor, expected an integer constant or loop "
                             "variable", name);
    if (kt__ktg_reported(p, t.at))
        return kt__ktg_error(p, t.at, "-");
    const char *near = kt__ktg_suggest_symbol(
        p, name, 1u << KT__KTG_SYM_CONST | 1u << KT__KTG_SYM_LOOPVAR);
    if (near != NULL)
        return kt__ktg_error(p, t.at, "'%s' is not defined (did you mean '%s'?), expected an "
                             "integer constant or loop variable", name, near);
    return kt__ktg_error(p, t.at, "'%s' is not defined, expected an integer constant or loop "
                         "variable", name);
}

static int unary(kt__ktg_parser *p, int64_t *v)
{
    if (p->tok.kind != KT__KTG_MINUS)
        return atom(p, v);
    kt__ktg_token minus = p->tok;
    kt__ktg_advance(p);
    int64_t x;
    if (!atom(p, &x))
        return 0;
    if (x == INT64_MIN)
        return kt__ktg_error(p, minus.at, "integer overflow in negation, expected a value "
                             "within int64");
    *v = -x;
    return 1;
}

static int mul_overflows(int64_t a, int64_t b)
{
    if (a == 0 || b == 0)
        return 0;
    if (a == -1)
        return b == INT64_MIN;
    if (b == -1)
        return a == INT64_MIN;
    if (a > 0)
        return b > 0 ? a > INT64_MAX / b : b < INT64_MIN / a;
    return b > 0 ? a < INT64_MIN / b : a < INT64_MAX / b;
}

static int term(kt__ktg_parser *p, int64_t *v)
{
    int64_t a;
    if (!unary(p, &a))
        return 0;
    while (p->tok.kind == KT__KTG_STAR || p->tok.kind == KT__KTG_SLASH ||
           p->tok.kind == KT__KTG_PERCENT) {
        kt__ktg_token op = p->tok;
        kt__ktg_advance(p);
        int64_t b;
        if (!unary(p, &b))
            return 0;
        if (op.kind == KT__KTG_STAR) {
            if (mul_overflows(a, b))
                return kt__ktg_error(p, op.at, "integer overflow in %lld * %lld, expected a "
                                     "product within int64", (long long)a, (long long)b);
            a *= b;
        } else {
            if (b == 0)
                return kt__ktg_error(p, op.at, "division by zero, expected a non-zero "
                                     "divisor");
            if (a == INT64_MIN && b == -1)
                return kt__ktg_error(p, op.at, "integer overflow in division, expected a "
                                     "quotient within int64");
            a = op.kind == KT__KTG_SLASH ? a / b : a % b;
        }
    }
    *v = a;
    return 1;
}

int kt__ktg_expr(kt__ktg_parser *p, int64_t *value_out)
{
    if (p->expr_depth >= KT__KTG_MAX_EXPR_DEPTH)
        return kt__ktg_error(p, p->tok.at, "expression nested too deeply, expected at most %d "
                             "levels", KT__KTG_MAX_EXPR_DEPTH);
    p->expr_depth++;
    int64_t a;
    int ok = term(p, &a);
    while (ok && (p->tok.kind == KT__KTG_PLUS || p->tok.kind == KT__KTG_MINUS)) {
        kt__ktg_token op = p->tok;
        kt__ktg_advance(p);
        int64_t b;
        if (!(ok = term(p, &b)))
            break;
        int over = op.kind == KT__KTG_PLUS
                       ? (b > 0 ? a > INT64_MAX - b : a < INT64_MIN - b)
                       : (b < 0 ? a > INT64_MAX + b : a < INT64_MIN + b);
        if (over) {
            ok = kt__ktg_error(p, op.at, "integer overflow in %lld %c %lld, expected a result "
                               "within int64", (long long)a,
                               op.kind == KT__KTG_PLUS ? '+' : '-', (long long)b);
            break;
        }
        a = op.kind == KT__KTG_PLUS ? a + b : a - b;
    }
    p->expr_depth--;
    if (ok)
        *value_out = a;
    return ok;
}

static int append_name(kt__ktg_parser *p, char *buf, size_t *n, const char *s, size_t len,
                       kt__ktg_span start)
{
    if (*n + len > KT__KTG_NAME_MAX)
        return kt__ktg_error(p, kt__ktg_span_to_here(p, start), "name too long, expected at "
                             "most %d bytes", KT__KTG_NAME_MAX);
    memcpy(buf + *n, s, len);
    *n += len;
    buf[*n] = '\0';
    return 1;
}

int kt__ktg_name(kt__ktg_parser *p, char *buf, kt__ktg_span *span_out)
{
    buf[0] = '\0';
    if (p->tok.kind != KT__KTG_IDENT)
        return kt__ktg_expected(p, "a name");
    kt__ktg_span start = p->tok.at;
    size_t n = 0;
    if (!append_name(p, buf, &n, p->lx.src + p->tok.at.off, p->tok.at.len, start))
        return 0;
    kt__ktg_advance(p);
    while (p->tok.kind == KT__KTG_LBRACE && p->tok.adjacent) {
        if (p->expr_depth >= KT__KTG_MAX_EXPR_DEPTH)
            return kt__ktg_error(p, p->tok.at, "names nested too deeply, expected at most %d "
                                 "levels", KT__KTG_MAX_EXPR_DEPTH);
        kt__ktg_advance(p);
        int64_t v;
        p->expr_depth++;
        int ok = kt__ktg_expr(p, &v);
        p->expr_depth--;
        if (!ok || !kt__ktg_expect(p, KT__KTG_RBRACE, "'}' to close the name's '{'")) {
            /* past the interpolation's '}' on this line, so that skipping the rest of the
             * statement does not take it for the end of an enclosing block */
            while (p->tok.kind != KT__KTG_RBRACE && p->tok.kind != KT__KTG_NEWLINE &&
                   p->tok.kind != KT__KTG_EOF)
                kt__ktg_advance(p);
            if (p->tok.kind == KT__KTG_RBRACE)
                kt__ktg_advance(p);
            return 0;
        }
        char digits[24];
        int len = snprintf(digits, sizeof digits, "%lld", (long long)v);
        if (!append_name(p, buf, &n, digits, (size_t)len, start))
            return 0;
        if (p->tok.kind == KT__KTG_TAIL) {
            if (!append_name(p, buf, &n, p->lx.src + p->tok.at.off, p->tok.at.len, start))
                return 0;
            kt__ktg_advance(p);
        }
    }
    if (p->tok.kind == KT__KTG_BAD && p->tok.adjacent && p->lx.src[p->tok.at.off] == '.')
        /* the lexer leaves a '.' out of a name when no component follows it */
        return kt__ktg_error(p, p->tok.at, "a name that ends with '.', expected a name part or "
                             "'{expr}' after the '.'");
    for (size_t i = 0; i < n; i++)
        if (buf[i] == '\0')
            buf[i] = '?'; /* cannot happen from the lexer's classes; keeps strings whole */
    if (span_out)
        *span_out = kt__ktg_span_to_here(p, start);
    return 1;
}

/* prefix[0..prefix_len) "." name into out (KT__KTG_NAME_MAX + 1 bytes); 0 when too long. */
static int join(char *out, const char *prefix, size_t prefix_len, const char *name)
{
    size_t n = strlen(name);
    if (prefix_len + 1 + n > KT__KTG_NAME_MAX)
        return 0;
    memmove(out + prefix_len + 1, name, n + 1); /* out may be name's own buffer */
    memcpy(out, prefix, prefix_len);
    out[prefix_len] = '.';
    return 1;
}

int kt__ktg_decl_name(kt__ktg_parser *p, char *buf, kt__ktg_span *span_out)
{
    kt__ktg_span at;
    if (!kt__ktg_name(p, buf, &at))
        return 0;
    if (span_out)
        *span_out = at;
    if (p->n_scopes == 0)
        return 1;
    size_t len = p->scope_end[p->n_scopes - 1];
    if (!join(buf, p->scope, len, buf))
        return kt__ktg_error(p, at, "name too long with the scope's prefix '%.*s.', expected "
                             "at most %d bytes in all", (int)len, p->scope, KT__KTG_NAME_MAX);
    return 1;
}

kt__ktg_sym *kt__ktg_resolve(kt__ktg_parser *p, const char *name, char *resolved)
{
    char full[KT__KTG_NAME_MAX + 1];
    for (int k = p->n_scopes; k > 0; k--) {
        snprintf(full, sizeof full, "%s", name);
        if (!join(full, p->scope, p->scope_end[k - 1], full))
            continue;
        kt__ktg_sym *s = kt__ktg_sym_find(&p->syms, full);
        if (s != NULL && s->kind != KT__KTG_SYM_NONE) {
            memcpy(resolved, full, sizeof full);
            return s;
        }
    }
    if (resolved != name)
        snprintf(resolved, KT__KTG_NAME_MAX + 1, "%s", name);
    kt__ktg_sym *s = kt__ktg_sym_find(&p->syms, name);
    return s != NULL && s->kind != KT__KTG_SYM_NONE ? s : NULL;
}

int kt__ktg_number(kt__ktg_parser *p, double *value_out)
{
    int neg = 0;
    kt__ktg_token t = p->tok;
    if (t.kind == KT__KTG_MINUS) {
        kt__ktg_token next = kt__ktg_peek(p);
        if (next.kind == KT__KTG_FLOAT) {
            neg = 1;
            kt__ktg_advance(p);
            t = p->tok;
        }
    }
    if (t.kind != KT__KTG_FLOAT) {
        int64_t v;
        if (!kt__ktg_expr(p, &v))
            return 0;
        *value_out = (double)v;
        return 1;
    }
    char text[64];
    if (t.at.len >= sizeof text)
        return kt__ktg_error(p, t.at, "number too long, expected at most %d characters",
                             (int)sizeof text - 1);
    kt__ktg_text(p, &t, text, sizeof text);
    errno = 0;
    char *end;
    double v = strtod(text, &end);
    if ((errno == ERANGE && (v > 1.0 || v < -1.0)) || v > 3.4e38)
        return kt__ktg_error(p, t.at, "number out of range, expected a finite f32 value");
    *value_out = neg ? -v : v;
    kt__ktg_advance(p);
    return 1;
}

int kt__ktg_dims(kt__ktg_parser *p, int64_t *dims, int *ndim_out, int positive)
{
    if (!kt__ktg_expect(p, KT__KTG_LBRACK, "'[' and the dimensions"))
        return 0;
    int ndim = 0;
    if (p->tok.kind == KT__KTG_RBRACK) {
        kt__ktg_advance(p);
        *ndim_out = 0;
        return 1;
    }
    for (;;) {
        kt__ktg_span start = p->tok.at;
        int64_t v;
        if (!kt__ktg_expr(p, &v))
            return 0;
        kt__ktg_span span = kt__ktg_span_to_here(p, start);
        if (ndim == KT_MAX_DIMS)
            return kt__ktg_error(p, span, "too many dimensions, expected at most %d",
                                 KT_MAX_DIMS);
        if (positive && v <= 0)
            return kt__ktg_error(p, span, "dimension %d is %lld, expected a positive size",
                                 ndim, (long long)v);
        dims[ndim++] = v;
        if (p->tok.kind == KT__KTG_COMMA) {
            kt__ktg_advance(p);
            continue;
        }
        if (!kt__ktg_expect(p, KT__KTG_RBRACK, "',' or ']'"))
            return 0;
        *ndim_out = ndim;
        return 1;
    }
}

int kt__ktg_not_hidden(kt__ktg_parser *p, const char *name, kt__ktg_span at)
{
    if (p->n_scopes == 0)
        return 1;
    char resolved[KT__KTG_NAME_MAX + 1];
    if (kt__ktg_resolve(p, name, resolved) == NULL || strcmp(resolved, name) == 0)
        return 1;
    return kt__ktg_error(p, at, "'%s' here means the scope's '%s', so a value bound to it could "
                         "not be read back, expected another name", name, resolved);
}
