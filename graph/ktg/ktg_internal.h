/* The .ktg parser (docs/ktg.md), shared by its files: the lexer, the diagnostics, the symbol
 * table, expressions and names, the statements and the op calls.
 *
 * The parser reads the text once, front to back, and builds the graph as it goes; a repeat
 * body is re-read from its saved lexer state once per iteration, so every iteration is
 * evaluated with the loop variable's value (names in the body are rebound each time). All
 * loops are bounded: by the input length, by a token budget and by a statement budget, and
 * recursion (blocks, parenthesised expressions) by explicit depth limits, so no input can
 * make the parser hang or overflow its stack. */
#ifndef KT_GRAPH_KTG_INTERNAL_H
#define KT_GRAPH_KTG_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "graph/strings.h"
#include "kt/graph.h"

#define KT__KTG_NAME_MAX 127        /* the builder's limit on names */
#define KT__KTG_MAX_ERRORS 100      /* diagnostics listed before giving up */
#define KT__KTG_MAX_BLOCK_DEPTH 16  /* nested repeat/checkpoint blocks */
#define KT__KTG_MAX_EXPR_DEPTH 64   /* nested parentheses and interpolations */
#define KT__KTG_MAX_STATEMENTS 65536 /* statements executed, repeat bodies counted each time */
#define KT__KTG_MAX_TOKENS (1u << 23) /* tokens read, re-reads of repeat bodies included */

typedef enum kt__ktg_kind {
    KT__KTG_EOF = 0,
    KT__KTG_NEWLINE,
    KT__KTG_IDENT,
    KT__KTG_TAIL,  /* the rest of a name right after an interpolation's '}': ".attn", "_b" */
    KT__KTG_INT,
    KT__KTG_FLOAT,
    KT__KTG_LPAREN,
    KT__KTG_RPAREN,
    KT__KTG_LBRACK,
    KT__KTG_RBRACK,
    KT__KTG_LBRACE,
    KT__KTG_RBRACE,
    KT__KTG_COMMA,
    KT__KTG_COLON,
    KT__KTG_EQ,
    KT__KTG_PLUS,
    KT__KTG_MINUS,
    KT__KTG_STAR,
    KT__KTG_SLASH,
    KT__KTG_PERCENT,
    KT__KTG_DOTDOT,
    KT__KTG_BAD /* a character that starts no token */
} kt__ktg_kind;

/* A piece of the source: where it starts and how long it is (for the caret line). */
typedef struct kt__ktg_span {
    size_t off, len;
    int line, col; /* 1-based; col counts bytes */
} kt__ktg_span;

typedef struct kt__ktg_token {
    kt__ktg_kind kind;
    kt__ktg_span at;
    int adjacent; /* no space between the previous token and this one */
    int first;    /* the first token of its line (a block's closing '}' is) */
} kt__ktg_token;

typedef struct kt__ktg_lexer {
    const char *src;
    size_t len, pos;
    int line, col;
    kt__ktg_kind prev_kind;
    size_t prev_end;
    uint64_t n_tokens;
} kt__ktg_lexer;

void kt__ktg_lex_init(kt__ktg_lexer *lx, const char *src, size_t len);
kt__ktg_token kt__ktg_lex_next(kt__ktg_lexer *lx);

/* ---- diagnostics ------------------------------------------------------------------------ */

typedef struct kt__ktg_diag {
    const char *src;
    size_t src_len;
    const char *filename;
    char *buf;
    size_t size, len;
    int n_errors;
    int n_graph_errors; /* rejected by the builder (shapes, dtypes): KT_EINVAL when alone */
    size_t seen[KT__KTG_MAX_ERRORS]; /* offsets already reported (repeat bodies re-run) */
    int n_seen;
    char first[640]; /* the first diagnostic's message line, for kt_last_error */
} kt__ktg_diag;

/* Records one error at `at` (unless that position was reported already). Returns 1 when the
 * error cap has been reached and parsing should stop. */
int kt__ktg_diag_error(kt__ktg_diag *d, kt__ktg_span at, int graph_error, const char *msg);
/* An error with no position (a bad -D define). */
void kt__ktg_diag_plain(kt__ktg_diag *d, const char *msg);
/* Levenshtein distance of two short strings (each cut at 64 bytes). */
int kt__ktg_edit_distance(const char *a, const char *b);
/* Whether `candidate` is a plausible misspelling of `word` (small edit distance). */
int kt__ktg_is_near(const char *word, const char *candidate, int *distance_out);

/* ---- symbols ------------------------------------------------------------------------------ */

typedef enum kt__ktg_sym_kind {
    KT__KTG_SYM_NONE = 0,  /* unbound (a finished loop's variable) */
    KT__KTG_SYM_CONST,
    KT__KTG_SYM_LOOPVAR,
    KT__KTG_SYM_LEAF,      /* an input or parameter */
    KT__KTG_SYM_VALUE,     /* an op output */
    KT__KTG_SYM_BROKEN     /* named by a statement that failed: its uses report nothing more */
} kt__ktg_sym_kind;

typedef struct kt__ktg_sym {
    int32_t name; /* offset in the table's pool */
    kt__ktg_sym_kind kind;
    int64_t ival;   /* CONST, LOOPVAR */
    kt_value value; /* LEAF, VALUE */
    int is_input;
    int line, col;  /* where it was first bound */
} kt__ktg_sym;

typedef struct kt__ktg_symbols {
    kt__ktg_sym *syms;
    int32_t n, cap;
    int32_t *slots; /* open addressing: index into syms, -1 empty */
    uint32_t n_slots;
    kt__strings names;
} kt__ktg_symbols;

/* The entry named `name` (bound or not), or NULL. */
kt__ktg_sym *kt__ktg_sym_find(kt__ktg_symbols *t, const char *name);
/* The entry named `name`, created unbound when absent; NULL when out of memory. */
kt__ktg_sym *kt__ktg_sym_get(kt__ktg_symbols *t, const char *name);
const char *kt__ktg_sym_name(const kt__ktg_symbols *t, const kt__ktg_sym *s);
void kt__ktg_sym_free(kt__ktg_symbols *t);

/* ---- the parser ----------------------------------------------------------------------------- */

typedef struct kt__ktg_parser {
    kt__ktg_lexer lx;
    kt__ktg_token tok; /* the current token */
    size_t last_end;   /* where the last consumed token ends */
    kt__ktg_diag diag;
    kt_graph *g;
    kt__ktg_symbols syms;
    const kt_ktg_define *defines;
    int n_defines;
    unsigned char *define_used;
    int stop;         /* the error cap or a budget was hit: unwind without reading on */
    int failed;       /* the current statement already reported its error */
    /* The current statement uses a name whose statement failed: it is still read and checked
     * for its own mistakes, but builds nothing and reports nothing about that name. */
    int poisoned;
    int64_t n_statements;
    int block_depth, expr_depth;
    /* The enclosing `scope` blocks: their prefixes joined by '.', and where each ends. */
    char scope[KT__KTG_NAME_MAX + 1];
    size_t scope_end[KT__KTG_MAX_BLOCK_DEPTH];
    int n_scopes;
} kt__ktg_parser;

/* Moves to the next token (stops the parser when the token budget is spent). */
void kt__ktg_advance(kt__ktg_parser *p);
/* The token after the current one, without consuming anything. */
kt__ktg_token kt__ktg_peek(kt__ktg_parser *p);
int kt__ktg_is_word(const kt__ktg_parser *p, const kt__ktg_token *t, const char *word);
/* Copies a token's text (cut to size - 1 bytes, NUL bytes replaced). */
void kt__ktg_text(const kt__ktg_parser *p, const kt__ktg_token *t, char *buf, size_t size);
/* "'matmul'", "end of line", "end of file": how a token is named in messages. */
const char *kt__ktg_describe(const kt__ktg_parser *p, const kt__ktg_token *t, char *buf,
                             size_t size);

/* Reports a syntax or name error at `at`; marks the statement failed. Always returns 0 so
 * that callers can `return kt__ktg_error(...)`. */
int kt__ktg_error(kt__ktg_parser *p, kt__ktg_span at, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
/* Whether an error at this position was reported already (a repeat body's later
 * iterations): callers skip costly suggestions then. */
int kt__ktg_reported(const kt__ktg_parser *p, kt__ktg_span at);
/* Reports the builder's last error (a shape or dtype rejection) at `at`. Returns 0. */
int kt__ktg_graph_error(kt__ktg_parser *p, kt__ktg_span at);
/* "expected X, got Y" at the current token. Returns 0. */
int kt__ktg_expected(kt__ktg_parser *p, const char *what);
/* Consumes a token of the given kind or reports "expected <what>". Returns 1 on success. */
int kt__ktg_expect(kt__ktg_parser *p, kt__ktg_kind kind, const char *what);

/* expr := term { (+|-) term }, evaluated in int64 with overflow and division checks. */
int kt__ktg_expr(kt__ktg_parser *p, int64_t *value_out);
/* A name with {expr} parts, into buf (at least KT__KTG_NAME_MAX + 1 bytes); span_out covers
 * the whole name. */
int kt__ktg_name(kt__ktg_parser *p, char *buf, kt__ktg_span *span_out);
/* The name a param or input declares: the name read, prefixed by the enclosing scopes
 * ("model.layers.3" + "." + name). */
int kt__ktg_decl_name(kt__ktg_parser *p, char *buf, kt__ktg_span *span_out);
/* The bound entry a name written inside scopes refers to: the innermost scope's prefix + "." +
 * name first, then each enclosing one, then the name as written; resolved gets that name.
 * NULL when none is bound. */
kt__ktg_sym *kt__ktg_resolve(kt__ktg_parser *p, const char *name, char *resolved);
/* A name an assignment or an alias binds as written: refused when, inside a scope, it would
 * be read back as the scope's parameter of that name instead. Returns 1 when it is fine. */
int kt__ktg_not_hidden(kt__ktg_parser *p, const char *name, kt__ktg_span at);
/* The source from `start` to the end of the last consumed token. */
kt__ktg_span kt__ktg_span_to_here(const kt__ktg_parser *p, kt__ktg_span start);
/* A float literal with an optional '-', or an integer expression. */
int kt__ktg_number(kt__ktg_parser *p, double *value_out);
/* "[" [expr {, expr}] "]" into dims (at most KT_MAX_DIMS). */
int kt__ktg_dims(kt__ktg_parser *p, int64_t *dims, int *ndim_out, int positive);
/* The closest of `n` candidate words to `word`, or NULL. */
const char *kt__ktg_suggest(const char *word, const char *const *candidates, int n);
/* The closest bound name to `word` among the kinds in `kinds_mask` (1 << kind), or NULL. */
const char *kt__ktg_suggest_symbol(kt__ktg_parser *p, const char *word, unsigned kinds_mask);

/* The tensor bound to a name (an input, parameter or op output), reading the name at the
 * current token (name_out, if not NULL, gets the name: KT__KTG_NAME_MAX + 1 bytes);
 * reports undefined names with a suggestion. */
int kt__ktg_value_ref(kt__ktg_parser *p, kt_value *value_out, char *name_out,
                     kt__ktg_span *span_out);
/* NAME [, NAME] = op(args): the statement starts at the current token. */
void kt__ktg_assign(kt__ktg_parser *p);
/* The other statements, after their keyword (the current token is the keyword). */
void kt__ktg_stmt_const(kt__ktg_parser *p, int top_level);
void kt__ktg_stmt_input(kt__ktg_parser *p);
void kt__ktg_stmt_param(kt__ktg_parser *p);
void kt__ktg_stmt_output(kt__ktg_parser *p);
void kt__ktg_stmt_loss(kt__ktg_parser *p);
void kt__ktg_stmt_policy(kt__ktg_parser *p);
void kt__ktg_stmt_shard(kt__ktg_parser *p);
/* Requires the end of the statement (a newline or the end of the file). */
int kt__ktg_end_of_statement(kt__ktg_parser *p);

#endif
