/* The bounded JSON parser behind the safetensors reader.
 *
 * Recursive descent, but the recursion depth is capped at KT__JSON_MAX_DEPTH so hostile
 * input cannot exhaust the stack. Elements of open containers collect on one growable
 * scratch stack and are copied into the arena when their container closes, so every
 * container costs exactly one arena allocation and the whole tree is freed at once.
 * Every read is checked against the input length; the input need not be NUL-terminated.
 */
#include "lib/io/json.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"

/* Big enough that a typical header fits in one block, small enough not to matter. */
#define ARENA_BLOCK_BYTES ((size_t)64 * 1024)

typedef struct arena_block {
    struct arena_block *next;
    size_t used, cap;
    max_align_t data[]; /* max_align_t so every carve-out is suitably aligned */
} arena_block;

struct kt__json_doc {
    arena_block *blocks;
    kt__json_value root;
};

typedef struct parser {
    const unsigned char *p;
    size_t len, pos;
    kt__json_doc *doc;
    kt__json_value *stack; /* elements of the containers being parsed, innermost last */
    size_t stack_len, stack_cap;
    int floats; /* fractions and exponents accepted (kt__json_parse_numbers) */
} parser;

static void *arena_alloc(kt__json_doc *doc, size_t size)
{
    const size_t align = _Alignof(max_align_t);
    if (size > SIZE_MAX - align)
        return NULL;
    size = (size + align - 1) / align * align;
    arena_block *b = doc->blocks;
    if (b == NULL || b->cap - b->used < size) {
        size_t cap = size > ARENA_BLOCK_BYTES ? size : ARENA_BLOCK_BYTES;
        if (cap > SIZE_MAX - sizeof(arena_block))
            return NULL;
        b = malloc(sizeof(arena_block) + cap);
        if (b == NULL)
            return NULL;
        b->used = 0;
        b->cap = cap;
        b->next = doc->blocks;
        doc->blocks = b;
    }
    void *r = (unsigned char *)b->data + b->used;
    b->used += size;
    return r;
}

static kt_status out_of_memory(const parser *ps)
{
    return kt__error(KT_ENOMEM, "JSON: out of memory parsing %zu bytes", ps->len);
}

/* "expected X, found Y at byte N", with Y described safely whatever the byte is. */
static kt_status syntax_error(const parser *ps, size_t at, const char *fmt, ...) KT__PRINTF(3, 4);
static kt_status syntax_error(const parser *ps, size_t at, const char *fmt, ...)
{
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    char found[32];
    if (at >= ps->len)
        snprintf(found, sizeof found, "end of input");
    else if (ps->p[at] >= 0x20 && ps->p[at] < 0x7f)
        snprintf(found, sizeof found, "'%c'", ps->p[at]);
    else
        snprintf(found, sizeof found, "byte 0x%02x", ps->p[at]);
    return kt__error(KT_EFORMAT, "JSON at byte %zu: %s, found %s", at, what, found);
}

static void skip_ws(parser *ps)
{
    while (ps->pos < ps->len) {
        unsigned char c = ps->p[ps->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            return;
        ps->pos++;
    }
}

static int at_char(const parser *ps, char c)
{
    return ps->pos < ps->len && ps->p[ps->pos] == (unsigned char)c;
}

static kt_status push(parser *ps, const kt__json_value *v)
{
    if (ps->stack_len == ps->stack_cap) {
        size_t cap = ps->stack_cap ? ps->stack_cap * 2 : 64;
        if (cap < ps->stack_cap || cap > SIZE_MAX / sizeof *ps->stack)
            return out_of_memory(ps);
        kt__json_value *s = realloc(ps->stack, cap * sizeof *s);
        if (s == NULL)
            return out_of_memory(ps);
        ps->stack = s;
        ps->stack_cap = cap;
    }
    ps->stack[ps->stack_len++] = *v;
    return KT_OK;
}

/* Moves the elements above `base` on the scratch stack into the arena as v's list. */
static kt_status close_container(parser *ps, size_t base, kt__json_value *v)
{
    size_t count = ps->stack_len - base;
    kt__json_value *items = NULL;
    if (count > 0) {
        items = arena_alloc(ps->doc, count * sizeof *items);
        if (items == NULL)
            return out_of_memory(ps);
        memcpy(items, ps->stack + base, count * sizeof *items);
    }
    ps->stack_len = base;
    v->u.list.items = items;
    v->u.list.count = count;
    return KT_OK;
}

static int hex_value(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Reads "\uXXXX" at q (which points at the backslash), bounded by end. */
static kt_status read_u_escape(const parser *ps, size_t q, size_t end, unsigned *unit_out)
{
    unsigned unit = 0;
    for (size_t i = q + 2; i < q + 6; i++) {
        int h = i < end ? hex_value(ps->p[i]) : -1;
        if (h < 0)
            return syntax_error(ps, i, "expected a hex digit in \\u escape");
        unit = unit * 16 + (unsigned)h;
    }
    *unit_out = unit;
    return KT_OK;
}

static size_t put_utf8(unsigned char *out, unsigned long cp)
{
    if (cp < 0x80) {
        out[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (unsigned char)(0xc0 | (cp >> 6));
        out[1] = (unsigned char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (unsigned char)(0xe0 | (cp >> 12));
        out[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (unsigned char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (unsigned char)(0xf0 | (cp >> 18));
    out[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (unsigned char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Length of the well-formed UTF-8 sequence at p[0..avail), or 0 if it is not one:
 * overlong forms, surrogates and code points above U+10FFFF are all rejected. */
static size_t utf8_sequence_len(const unsigned char *p, size_t avail)
{
    unsigned char c = p[0];
    size_t n;
    unsigned char lo = 0x80, hi = 0xbf; /* allowed range of the second byte */
    if (c < 0x80)
        return 1;
    if (c >= 0xc2 && c <= 0xdf) {
        n = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
        n = 3;
        if (c == 0xe0)
            lo = 0xa0;
        else if (c == 0xed)
            hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        n = 4;
        if (c == 0xf0)
            lo = 0x90;
        else if (c == 0xf4)
            hi = 0x8f;
    } else {
        return 0;
    }
    if (avail < n || p[1] < lo || p[1] > hi)
        return 0;
    for (size_t i = 2; i < n; i++)
        if (p[i] < 0x80 || p[i] > 0xbf)
            return 0;
    return n;
}

/* Decodes one escape starting at the backslash q; appends to out and advances q. */
static kt_status decode_escape(const parser *ps, size_t *q, size_t end, unsigned char *out,
                               size_t *out_len)
{
    size_t at = *q;
    if (end - at < 2)
        return syntax_error(ps, at + 1, "expected an escape character after '\\'");
    static const char simple_from[] = "\"\\/bfnrt";
    static const char simple_to[] = "\"\\/\b\f\n\r\t";
    const char *hit = memchr(simple_from, ps->p[at + 1], sizeof simple_from - 1);
    if (hit != NULL) {
        out[(*out_len)++] = (unsigned char)simple_to[hit - simple_from];
        *q = at + 2;
        return KT_OK;
    }
    if (ps->p[at + 1] != 'u')
        return syntax_error(ps, at + 1, "expected one of \" \\ / b f n r t u after '\\'");
    unsigned unit = 0;
    KT__TRY(read_u_escape(ps, at, end, &unit));
    unsigned long cp = unit;
    size_t next = at + 6;
    if (unit >= 0xdc00 && unit <= 0xdfff)
        return syntax_error(ps, at, "expected a high surrogate before low surrogate \\u%04x", unit);
    if (unit >= 0xd800 && unit <= 0xdbff) {
        unsigned low = 0;
        if (end - next < 2 || ps->p[next] != '\\' || ps->p[next + 1] != 'u')
            return syntax_error(ps, next, "expected a low surrogate after \\u%04x", unit);
        KT__TRY(read_u_escape(ps, next, end, &low));
        if (low < 0xdc00 || low > 0xdfff)
            return syntax_error(ps, next, "expected a low surrogate after \\u%04x", unit);
        cp = 0x10000 + (((unsigned long)unit - 0xd800) << 10) + (low - 0xdc00);
        next += 6;
    }
    *out_len += put_utf8(out + *out_len, cp);
    *q = next;
    return KT_OK;
}

/* At an opening quote. The decoded form is never longer than the raw text (an escape of
 * 6 or 12 bytes yields at most 4), so one allocation of the raw length suffices. */
static kt_status parse_string(parser *ps, const char **s_out, size_t *len_out)
{
    size_t start = ps->pos + 1, end = start;
    while (end < ps->len && ps->p[end] != '"')
        end += ps->p[end] == '\\' ? 2 : 1;
    if (end >= ps->len)
        return syntax_error(ps, ps->len, "expected '\"' to end the string at byte %zu", ps->pos);
    unsigned char *out = arena_alloc(ps->doc, end - start + 1);
    if (out == NULL)
        return out_of_memory(ps);
    size_t n = 0;
    for (size_t q = start; q < end;) {
        unsigned char c = ps->p[q];
        if (c == '\\') {
            KT__TRY(decode_escape(ps, &q, end, out, &n));
        } else if (c < 0x20) {
            return syntax_error(ps, q, "expected an escape for a control character");
        } else {
            size_t k = utf8_sequence_len(ps->p + q, end - q);
            if (k == 0)
                return syntax_error(ps, q, "expected valid UTF-8");
            memcpy(out + n, ps->p + q, k);
            n += k;
            q += k;
        }
    }
    out[n] = '\0';
    ps->pos = end + 1;
    *s_out = (const char *)out;
    *len_out = n;
    return KT_OK;
}

static int is_digit(const parser *ps, size_t at)
{
    return at < ps->len && ps->p[at] >= '0' && ps->p[at] <= '9';
}

/* The rest of a number whose integer part ends at ps->pos: JSON's fraction and exponent,
 * then the whole text converted with strtod (the C locale's '.' is JSON's). */
static kt_status parse_float(parser *ps, size_t start, kt__json_value *v)
{
    if (at_char(ps, '.')) {
        ps->pos++;
        if (!is_digit(ps, ps->pos))
            return syntax_error(ps, ps->pos, "expected a digit after '.'");
        while (is_digit(ps, ps->pos))
            ps->pos++;
    }
    if (at_char(ps, 'e') || at_char(ps, 'E')) {
        ps->pos++;
        if (at_char(ps, '+') || at_char(ps, '-'))
            ps->pos++;
        if (!is_digit(ps, ps->pos))
            return syntax_error(ps, ps->pos, "expected a digit in the exponent");
        while (is_digit(ps, ps->pos))
            ps->pos++;
    }
    char text[64];
    size_t n = ps->pos - start;
    if (n >= sizeof text)
        return kt__error(KT_EFORMAT, "JSON at byte %zu: number longer than %zu characters",
                         start, sizeof text - 1);
    memcpy(text, ps->p + start, n);
    text[n] = '\0';
    errno = 0;
    double d = strtod(text, NULL);
    if (errno == ERANGE && (d > 1.0 || d < -1.0))
        return kt__error(KT_EFORMAT, "JSON at byte %zu: number %s out of range", start, text);
    v->type = KT__JSON_FLOAT;
    v->u.number = d;
    return KT_OK;
}

static kt_status parse_int(parser *ps, kt__json_value *v)
{
    size_t start = ps->pos;
    int negative = at_char(ps, '-');
    if (negative)
        ps->pos++;
    if (!is_digit(ps, ps->pos))
        return syntax_error(ps, ps->pos, "expected a digit");
    if (ps->p[ps->pos] == '0' && is_digit(ps, ps->pos + 1))
        return syntax_error(ps, ps->pos + 1, "expected no leading zeros");
    uint64_t mag = 0;
    for (; is_digit(ps, ps->pos); ps->pos++) {
        unsigned d = ps->p[ps->pos] - '0';
        if (mag > (UINT64_MAX - d) / 10 && ps->floats) {
            while (is_digit(ps, ps->pos))
                ps->pos++;
            return parse_float(ps, start, v); /* a whole number too large for 64 bits */
        }
        if (mag > (UINT64_MAX - d) / 10)
            return kt__error(KT_EFORMAT, "JSON at byte %zu: integer out of range", start);
        mag = mag * 10 + d;
    }
    if ((at_char(ps, '.') || at_char(ps, 'e') || at_char(ps, 'E')) && ps->floats)
        return parse_float(ps, start, v);
    if (at_char(ps, '.') || at_char(ps, 'e') || at_char(ps, 'E'))
        return syntax_error(ps, ps->pos,
                            "expected an integer (fractions and exponents are not supported)");
    if (negative && mag > (uint64_t)1 << 63)
        return kt__error(KT_EFORMAT, "JSON at byte %zu: integer out of range", start);
    v->type = KT__JSON_INT;
    v->u.integer.negative = negative && mag != 0;
    v->u.integer.magnitude = mag;
    return KT_OK;
}

static kt_status parse_literal(parser *ps, kt__json_value *v)
{
    static const struct {
        const char *text;
        kt__json_type type;
        int boolean;
    } literals[] = {
        {"true", KT__JSON_BOOL, 1}, {"false", KT__JSON_BOOL, 0}, {"null", KT__JSON_NULL, 0}};
    for (size_t i = 0; i < sizeof literals / sizeof literals[0]; i++) {
        size_t n = strlen(literals[i].text);
        if (ps->len - ps->pos >= n && memcmp(ps->p + ps->pos, literals[i].text, n) == 0) {
            v->type = literals[i].type;
            v->u.boolean = literals[i].boolean;
            ps->pos += n;
            return KT_OK;
        }
    }
    return syntax_error(ps, ps->pos, "expected a value");
}

static kt_status parse_value(parser *ps, int depth, kt__json_value *v);

static kt_status parse_array(parser *ps, int depth, kt__json_value *v)
{
    size_t base = ps->stack_len;
    ps->pos++;
    skip_ws(ps);
    if (at_char(ps, ']')) {
        ps->pos++;
    } else {
        for (;;) {
            kt__json_value item;
            KT__TRY(parse_value(ps, depth, &item));
            KT__TRY(push(ps, &item));
            skip_ws(ps);
            if (at_char(ps, ']')) {
                ps->pos++;
                break;
            }
            if (!at_char(ps, ','))
                return syntax_error(ps, ps->pos, "expected ',' or ']' in an array");
            ps->pos++;
        }
    }
    v->type = KT__JSON_ARRAY;
    return close_container(ps, base, v);
}

static kt_status parse_object(parser *ps, int depth, kt__json_value *v)
{
    size_t base = ps->stack_len;
    ps->pos++;
    skip_ws(ps);
    if (at_char(ps, '}')) {
        ps->pos++;
    } else {
        for (;;) {
            skip_ws(ps);
            if (!at_char(ps, '"'))
                return syntax_error(ps, ps->pos, "expected '\"' to start an object key");
            const char *key;
            size_t key_len;
            KT__TRY(parse_string(ps, &key, &key_len));
            skip_ws(ps);
            if (!at_char(ps, ':'))
                return syntax_error(ps, ps->pos, "expected ':' after an object key");
            ps->pos++;
            kt__json_value member;
            KT__TRY(parse_value(ps, depth, &member));
            member.key = key;
            member.key_len = key_len;
            KT__TRY(push(ps, &member));
            skip_ws(ps);
            if (at_char(ps, '}')) {
                ps->pos++;
                break;
            }
            if (!at_char(ps, ','))
                return syntax_error(ps, ps->pos, "expected ',' or '}' in an object");
            ps->pos++;
        }
    }
    v->type = KT__JSON_OBJECT;
    return close_container(ps, base, v);
}

static kt_status parse_value(parser *ps, int depth, kt__json_value *v)
{
    skip_ws(ps);
    memset(v, 0, sizeof *v);
    v->offset = ps->pos;
    if (ps->pos >= ps->len)
        return syntax_error(ps, ps->pos, "expected a value");
    unsigned char c = ps->p[ps->pos];
    if ((c == '[' || c == '{') && depth >= KT__JSON_MAX_DEPTH)
        return kt__error(KT_EFORMAT, "JSON at byte %zu: nesting deeper than %d levels", ps->pos,
                         KT__JSON_MAX_DEPTH);
    if (c == '[')
        return parse_array(ps, depth + 1, v);
    if (c == '{')
        return parse_object(ps, depth + 1, v);
    if (c == '"') {
        v->type = KT__JSON_STRING;
        return parse_string(ps, &v->u.string.s, &v->u.string.len);
    }
    if (c == '-' || (c >= '0' && c <= '9'))
        return parse_int(ps, v);
    return parse_literal(ps, v);
}

static kt_status parse_document(const char *text, size_t len, int floats,
                                kt__json_doc **doc_out)
{
    if ((text == NULL && len > 0) || doc_out == NULL)
        return kt__error(KT_EINVAL, "kt__json_parse: NULL argument");
    kt_status s = KT_OK;
    parser ps = {.p = (const unsigned char *)text, .len = len, .floats = floats};
    ps.doc = calloc(1, sizeof *ps.doc);
    if (ps.doc == NULL) {
        s = out_of_memory(&ps);
        goto done;
    }
    s = parse_value(&ps, 0, &ps.doc->root);
    if (s != KT_OK)
        goto done;
    skip_ws(&ps);
    if (ps.pos != len)
        s = syntax_error(&ps, ps.pos, "expected end of input after the value");
done:
    free(ps.stack);
    if (s != KT_OK) {
        kt__json_free(ps.doc);
        return s;
    }
    *doc_out = ps.doc;
    return KT_OK;
}

kt_status kt__json_parse(const char *text, size_t len, kt__json_doc **doc_out)
{
    return parse_document(text, len, 0, doc_out);
}

kt_status kt__json_parse_numbers(const char *text, size_t len, kt__json_doc **doc_out)
{
    return parse_document(text, len, 1, doc_out);
}

const kt__json_value *kt__json_root(const kt__json_doc *doc) { return &doc->root; }

void kt__json_free(kt__json_doc *doc)
{
    if (doc == NULL)
        return;
    for (arena_block *b = doc->blocks, *next; b != NULL; b = next) {
        next = b->next;
        free(b);
    }
    free(doc);
}

int kt__json_utf8_valid(const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < len;) {
        size_t k = utf8_sequence_len(p + i, len - i);
        if (k == 0)
            return 0;
        i += k;
    }
    return 1;
}

const char *kt__json_type_name(kt__json_type type)
{
    switch (type) {
    case KT__JSON_NULL:
        return "null";
    case KT__JSON_BOOL:
        return "boolean";
    case KT__JSON_INT:
        return "integer";
    case KT__JSON_STRING:
        return "string";
    case KT__JSON_ARRAY:
        return "array";
    case KT__JSON_OBJECT:
        return "object";
    case KT__JSON_FLOAT:
        return "number";
    }
    return "?";
}

const kt__json_value *kt__json_member(const kt__json_value *obj, const char *key)
{
    if (obj == NULL || obj->type != KT__JSON_OBJECT)
        return NULL;
    const kt__json_value *found = NULL;
    const size_t len = strlen(key);
    for (size_t i = 0; i < obj->u.list.count; i++) {
        const kt__json_value *m = &obj->u.list.items[i];
        if (m->key_len == len && memcmp(m->key, key, len) == 0)
            found = m;
    }
    return found;
}
