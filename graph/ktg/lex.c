/* The .ktg lexer: tokens with their line and column. It never reads past `len` (the text
 * need not be NUL-terminated) and every call consumes at least one byte or returns EOF, so
 * lexing always terminates. */
#include <string.h>

#include "graph/ktg/ktg_internal.h"

static int is_alpha(int c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_'; }
static int is_digit(int c) { return c >= '0' && c <= '9'; }
static int is_word(int c) { return is_alpha(c) || is_digit(c); }
/* a name's '.' needs a name character or an interpolation's '{' after it */
static int dot_continues(int next) { return is_word(next) || next == '{'; }

void kt__ktg_lex_init(kt__ktg_lexer *lx, const char *src, size_t len)
{
    lx->src = src;
    lx->len = len;
    /* a UTF-8 byte-order mark (editors on Windows write one) is not part of the text */
    lx->pos = len >= 3 && memcmp(src, "\xef\xbb\xbf", 3) == 0 ? 3 : 0;
    lx->line = 1;
    lx->col = 1;
    lx->prev_kind = KT__KTG_NEWLINE;
    lx->prev_end = 0;
    lx->n_tokens = 0;
}

static int at(const kt__ktg_lexer *lx, size_t i) { return i < lx->len ? (unsigned char)lx->src[i] : -1; }

static void bump(kt__ktg_lexer *lx)
{
    if (lx->src[lx->pos] == '\n') {
        lx->line++;
        lx->col = 1;
    } else {
        lx->col++;
    }
    lx->pos++;
}

/* Spaces, tabs, carriage returns and comments; stops at a newline. */
static void skip_blanks(kt__ktg_lexer *lx)
{
    while (lx->pos < lx->len) {
        int c = at(lx, lx->pos);
        if (c == ' ' || c == '\t' || c == '\r') {
            bump(lx);
        } else if (c == '#') {
            while (lx->pos < lx->len && lx->src[lx->pos] != '\n')
                bump(lx);
        } else {
            break;
        }
    }
}

/* Whether the first significant character after this newline (past blank lines and
 * comments) closes a bracket: then the statement goes on, as in "f(\n  x\n)". */
static int next_closes(const kt__ktg_lexer *lx)
{
    for (size_t i = lx->pos; i < lx->len; i++) {
        int c = at(lx, i);
        if (c == '#') {
            while (i < lx->len && lx->src[i] != '\n')
                i++;
            if (i >= lx->len)
                return 0;
        } else if (c != ' ' && c != '\t' && c != '\r' && c != '\n') {
            return c == ')' || c == ']';
        }
    }
    return 0;
}

/* A newline continues the statement after an opening bracket or a comma, and before a
 * closing bracket. The look-ahead is done only after a significant token, so a run of blank
 * lines is scanned at most twice. */
static int continues(const kt__ktg_lexer *lx)
{
    kt__ktg_kind k = lx->prev_kind;
    if (k == KT__KTG_LPAREN || k == KT__KTG_LBRACK || k == KT__KTG_COMMA)
        return 1;
    if (k == KT__KTG_NEWLINE)
        return 0;
    return next_closes(lx);
}

static void lex_word_rest(kt__ktg_lexer *lx)
{
    /* '.' belongs to a name only before a word character or a '{' (the next component is
     * interpolated: "model.layers.{l}"), so "N..M" is N .. M */
    while (lx->pos < lx->len) {
        int c = at(lx, lx->pos);
        if (is_word(c) || (c == '.' && dot_continues(at(lx, lx->pos + 1))))
            bump(lx);
        else
            break;
    }
}

static kt__ktg_kind lex_number(kt__ktg_lexer *lx)
{
    kt__ktg_kind kind = KT__KTG_INT;
    while (lx->pos < lx->len && is_digit(at(lx, lx->pos)))
        bump(lx);
    if (at(lx, lx->pos) == '.' && is_digit(at(lx, lx->pos + 1))) {
        kind = KT__KTG_FLOAT;
        bump(lx);
        while (lx->pos < lx->len && is_digit(at(lx, lx->pos)))
            bump(lx);
    }
    int e = at(lx, lx->pos);
    if (e == 'e' || e == 'E') {
        size_t d = lx->pos + 1;
        if (at(lx, d) == '+' || at(lx, d) == '-')
            d++;
        if (is_digit(at(lx, d))) {
            kind = KT__KTG_FLOAT;
            while (lx->pos < d)
                bump(lx);
            while (lx->pos < lx->len && is_digit(at(lx, lx->pos)))
                bump(lx);
        }
    }
    return kind;
}

kt__ktg_token kt__ktg_lex_next(kt__ktg_lexer *lx)
{
    kt__ktg_token t;
    int crossed = 0; /* a continued line: the token still starts a line */
    lx->n_tokens++;
    for (;;) {
        skip_blanks(lx);
        if (lx->pos < lx->len && lx->src[lx->pos] == '\n' && continues(lx)) {
            bump(lx);
            crossed = 1;
            continue;
        }
        break;
    }
    t.at.off = lx->pos;
    t.at.line = lx->line;
    t.at.col = lx->col;
    t.adjacent = lx->pos == lx->prev_end && lx->prev_kind != KT__KTG_NEWLINE;
    t.first = lx->prev_kind == KT__KTG_NEWLINE || crossed;
    if (lx->pos >= lx->len) {
        t.kind = KT__KTG_EOF;
        t.at.len = 0;
        lx->prev_kind = t.kind;
        return t;
    }
    int c = at(lx, lx->pos);
    if (t.adjacent && lx->prev_kind == KT__KTG_RBRACE &&
        (is_word(c) || (c == '.' && dot_continues(at(lx, lx->pos + 1))))) {
        bump(lx);
        lex_word_rest(lx);
        t.kind = KT__KTG_TAIL;
    } else if (is_alpha(c)) {
        bump(lx);
        lex_word_rest(lx);
        t.kind = KT__KTG_IDENT;
    } else if (is_digit(c)) {
        t.kind = lex_number(lx);
    } else if (c == '.' && at(lx, lx->pos + 1) == '.') {
        bump(lx);
        bump(lx);
        t.kind = KT__KTG_DOTDOT;
    } else if (c == '.' && is_digit(at(lx, lx->pos + 1))) {
        /* ".5": a float the grammar does not allow; lexed whole so the message names it */
        bump(lx);
        lex_number(lx);
        t.kind = KT__KTG_FLOAT;
    } else {
        static const struct {
            char c;
            kt__ktg_kind kind;
        } punct[] = {{'\n', KT__KTG_NEWLINE}, {'(', KT__KTG_LPAREN}, {')', KT__KTG_RPAREN},
                     {'[', KT__KTG_LBRACK},   {']', KT__KTG_RBRACK},  {'{', KT__KTG_LBRACE},
                     {'}', KT__KTG_RBRACE},   {',', KT__KTG_COMMA},   {':', KT__KTG_COLON},
                     {'=', KT__KTG_EQ},       {'+', KT__KTG_PLUS},    {'-', KT__KTG_MINUS},
                     {'*', KT__KTG_STAR},     {'/', KT__KTG_SLASH},   {'%', KT__KTG_PERCENT}};
        t.kind = KT__KTG_BAD;
        for (size_t i = 0; i < sizeof punct / sizeof punct[0]; i++)
            if (punct[i].c == c)
                t.kind = punct[i].kind;
        bump(lx);
    }
    t.at.len = lx->pos - t.at.off;
    lx->prev_kind = t.kind;
    lx->prev_end = lx->pos;
    return t;
}
