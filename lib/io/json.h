/* A small, bounded JSON parser for file headers (safetensors).
 *
 * It builds a read-only tree in one allocation arena owned by the document. It is strict:
 * strings must be valid UTF-8 with valid escapes (\uXXXX surrogate pairs are decoded to
 * UTF-8; lone surrogates and raw control characters are rejected), and numbers must be
 * integers in [-2^63, 2^64 - 1] without leading zeros, because headers never need
 * fractions and a silently rounded offset would be worse than an error. Readers of
 * configuration files (config.json) ask for fractions and exponents with
 * kt__json_parse_numbers: such numbers become KT__JSON_FLOAT (a double, finite), while plain
 * integers stay KT__JSON_INT. Nesting deeper than
 * KT__JSON_MAX_DEPTH is rejected before it can exhaust the stack. Errors are KT_EFORMAT
 * (KT_ENOMEM when an allocation fails) with the byte offset and what was expected.
 *
 * Memory: one node (about 56 bytes) per value plus the decoded strings, and as much again
 * in scratch space while parsing; a pathological input of N bytes such as "[0,0,0,...]"
 * peaks near 60N, which callers bound by limiting N.
 */
#ifndef KT_IO_JSON_H
#define KT_IO_JSON_H

#include <stddef.h>
#include <stdint.h>

#include "kt/status.h"

#define KT__JSON_MAX_DEPTH 16

typedef enum kt__json_type {
    KT__JSON_NULL,
    KT__JSON_BOOL,
    KT__JSON_INT,
    KT__JSON_STRING,
    KT__JSON_ARRAY,
    KT__JSON_OBJECT,
    KT__JSON_FLOAT /* only from kt__json_parse_numbers */
} kt__json_type;

typedef struct kt__json_value kt__json_value;

struct kt__json_value {
    kt__json_type type;
    size_t offset;   /* where the value starts in the input, for error messages */
    const char *key; /* the member name when this value sits in an object, else NULL */
    size_t key_len;  /* keys and strings are NUL-terminated but may also contain NULs */
    union {
        int boolean;
        struct {
            int negative;
            uint64_t magnitude; /* |value|; at most 2^63 when negative */
        } integer;
        struct {
            const char *s;
            size_t len;
        } string;
        double number; /* KT__JSON_FLOAT */
        struct {
            const kt__json_value *items; /* array elements, or object members in order */
            size_t count;
        } list;
    } u;
};

typedef struct kt__json_doc kt__json_doc;

/* Parses exactly one value, optionally surrounded by whitespace, from text[0..len). */
kt_status kt__json_parse(const char *text, size_t len, kt__json_doc **doc_out);
/* The same, also accepting numbers with a fraction or an exponent (JSON's grammar; a value
 * beyond the range of a double is an error). */
kt_status kt__json_parse_numbers(const char *text, size_t len, kt__json_doc **doc_out);
const kt__json_value *kt__json_root(const kt__json_doc *doc);
void kt__json_free(kt__json_doc *doc);

/* 1 when s[0..len) is well-formed UTF-8 (no overlong forms, surrogates or code points
 * above U+10FFFF): the writer checks names with it so it never writes what the parser would
 * reject. */
int kt__json_utf8_valid(const char *s, size_t len);

/* "object", "string", ... for messages. */
const char *kt__json_type_name(kt__json_type type);
/* The member of an object called key (the last of duplicates, as Python's json module
 * keeps), or NULL: obj NULL or not an object, or no such member. */
const kt__json_value *kt__json_member(const kt__json_value *obj, const char *key);

#endif
