/* The parser's token handling and error reporting, used by every statement. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "graph/ktg/ktg_internal.h"

void kt__ktg_advance(kt__ktg_parser *p)
{
    if (p->stop) {
        /* every loop ends at EOF, so a stopped parser unwinds without reading on */
        p->tok.kind = KT__KTG_EOF;
        return;
    }
    p->last_end = p->tok.at.off + p->tok.at.len;
    p->tok = kt__ktg_lex_next(&p->lx);
    if (p->lx.n_tokens > KT__KTG_MAX_TOKENS) {
        kt__ktg_error(p, p->tok.at, "the model is too large to read (more than %u tokens, "
                      "repeat bodies counted once per iteration), expected a smaller file",
                      KT__KTG_MAX_TOKENS);
        p->stop = 1;
        p->tok.kind = KT__KTG_EOF;
    }
}

kt__ktg_token kt__ktg_peek(kt__ktg_parser *p)
{
    if (p->stop || p->tok.kind == KT__KTG_EOF)
        return p->tok;
    kt__ktg_lexer copy = p->lx;
    return kt__ktg_lex_next(&copy);
}

int kt__ktg_is_word(const kt__ktg_parser *p, const kt__ktg_token *t, const char *word)
{
    size_t n = strlen(word);
    return t->kind == KT__KTG_IDENT && t->at.len == n &&
           memcmp(p->lx.src + t->at.off, word, n) == 0;
}

void kt__ktg_text(const kt__ktg_parser *p, const kt__ktg_token *t, char *buf, size_t size)
{
    size_t n = t->at.len < size - 1 ? t->at.len : size - 1;
    for (size_t i = 0; i < n; i++) {
        char c = p->lx.src[t->at.off + i];
        buf[i] = c == '\0' ? '?' : c;
    }
    buf[n] = '\0';
}

const char *kt__ktg_describe(const kt__ktg_parser *p, const kt__ktg_token *t, char *buf,
                             size_t size)
{
    if (t->kind == KT__KTG_EOF) {
        snprintf(buf, size, "end of file");
    } else if (t->kind == KT__KTG_NEWLINE) {
        snprintf(buf, size, "end of line");
    } else {
        char text[48];
        kt__ktg_text(p, t, text, sizeof text);
        const unsigned char c = (unsigned char)p->lx.src[t->at.off]; /* (text shows NUL as ?) */
        if (t->kind == KT__KTG_BAD && (c < 0x20 || c >= 0x7f))
            snprintf(buf, size, "character 0x%02x", c);
        else
            snprintf(buf, size, "'%s%s'", text, t->at.len >= sizeof text ? "..." : "");
    }
    return buf;
}

int kt__ktg_error(kt__ktg_parser *p, kt__ktg_span at, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (kt__ktg_diag_error(&p->diag, at, 0, msg))
        p->stop = 1;
    p->failed = 1;
    return 0;
}

int kt__ktg_reported(const kt__ktg_parser *p, kt__ktg_span at)
{
    for (int i = 0; i < p->diag.n_seen; i++)
        if (p->diag.seen[i] == at.off)
            return 1;
    return 0;
}

int kt__ktg_graph_error(kt__ktg_parser *p, kt__ktg_span at)
{
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kt_last_error());
    if (kt__ktg_diag_error(&p->diag, at, 1, msg))
        p->stop = 1;
    p->failed = 1;
    return 0;
}

int kt__ktg_expected(kt__ktg_parser *p, const char *what)
{
    char d[64];
    const char *got = kt__ktg_describe(p, &p->tok, d, sizeof d);
    return kt__ktg_error(p, p->tok.at, "unexpected %s, expected %s", got, what);
}

int kt__ktg_expect(kt__ktg_parser *p, kt__ktg_kind kind, const char *what)
{
    if (p->tok.kind != kind)
        return kt__ktg_expected(p, what);
    kt__ktg_advance(p);
    return 1;
}

int kt__ktg_end_of_statement(kt__ktg_parser *p)
{
    kt__ktg_kind k = p->tok.kind;
    if (k == KT__KTG_NEWLINE || k == KT__KTG_EOF)
        return 1;
    return kt__ktg_expected(p, "the end of the statement");
}

const char *kt__ktg_suggest_symbol(kt__ktg_parser *p, const char *word, unsigned kinds_mask)
{
    const char *best = NULL;
    int best_dist = 1 << 30;
    size_t n = strlen(word);
    /* bounded: a suggestion is a courtesy, and a repeat can bind tens of thousands of names */
    for (int32_t i = 0; i < p->syms.n && i < 4096; i++) {
        const kt__ktg_sym *s = &p->syms.syms[i];
        if (!(kinds_mask & (1u << s->kind)))
            continue;
        const char *name = kt__ktg_sym_name(&p->syms, s);
        size_t m = strlen(name);
        if (m + 3 < n || n + 3 < m)
            continue; /* too far apart in length to be near */
        int dist;
        if (kt__ktg_is_near(word, name, &dist) && dist < best_dist) {
            best = name;
            best_dist = dist;
        }
    }
    return best;
}

kt__ktg_span kt__ktg_span_to_here(const kt__ktg_parser *p, kt__ktg_span start)
{
    kt__ktg_span s = start;
    s.len = p->last_end > start.off ? p->last_end - start.off : start.len;
    return s;
}
