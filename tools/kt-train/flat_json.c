/* A reader for the JSON kt-train writes itself (run.json): nested objects of strings and
 * integers, flattened into "outer.inner" paths. Anything else (arrays, fractions, a value too
 * long, text after the end) is refused with the byte offset: a file that is not what
 * kt-train wrote is a corrupt checkpoint, not something to guess at. kt-train uses the public
 * API only, so it does not borrow the library's internal parser. */
#include <stdio.h>
#include <string.h>

#include "tools/kt-train/flat_json.h"

typedef struct reader {
    const char *s;
    size_t len, at;
    flat_json *out;
    char *err;
    size_t err_size;
} reader;

static int fail(reader *r, const char *what)
{
    snprintf(r->err, r->err_size, "%s at byte %zu", what, r->at);
    return -1;
}

static void skip_space(reader *r)
{
    while (r->at < r->len && strchr(" \t\r\n", r->s[r->at]) != NULL && r->s[r->at] != '\0')
        r->at++;
}

static int expect(reader *r, char c)
{
    skip_space(r);
    if (r->at >= r->len || r->s[r->at] != c) {
        char what[32];
        snprintf(what, sizeof what, "expected '%c'", c);
        return fail(r, what);
    }
    r->at++;
    return 0;
}

/* Four hex digits (exactly: no sign, no space) as a number, or -1. */
static int hex4(const char *p)
{
    int v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

/* a string into buf: \" \\ \/ and \u00XX (what the writer escapes) */
static int string(reader *r, char *buf, size_t size)
{
    if (expect(r, '"') != 0)
        return -1;
    size_t n = 0;
    while (r->at < r->len && r->s[r->at] != '"') {
        char c = r->s[r->at++];
        if ((unsigned char)c < 0x20)
            return fail(r, "a control character in a string");
        if (c == '\\') {
            if (r->at >= r->len)
                return fail(r, "a truncated escape");
            char e = r->s[r->at++];
            if (e == 'u') {
                int v = r->at + 4 <= r->len ? hex4(r->s + r->at) : -1;
                if (v <= 0 || v > 0x7f) /* \u0000 would cut the value short */
                    return fail(r, "an escape kt-train does not write");
                r->at += 4;
                c = (char)v;
            } else if (e == '"' || e == '\\' || e == '/') {
                c = e;
            } else {
                return fail(r, "an escape kt-train does not write");
            }
        }
        if (n + 1 >= size)
            return fail(r, "a string too long");
        buf[n++] = c;
    }
    if (r->at >= r->len)
        return fail(r, "an unterminated string");
    r->at++;
    buf[n] = '\0';
    return 0;
}

static int object(reader *r, const char *prefix, int depth);

static int member(reader *r, const char *prefix, int depth)
{
    char key[64], path[FLAT_JSON_PATH];
    if (string(r, key, sizeof key) != 0 || expect(r, ':') != 0)
        return -1;
    int n = snprintf(path, sizeof path, "%s%s%s", prefix, *prefix ? "." : "", key);
    if (n < 0 || (size_t)n >= sizeof path)
        return fail(r, "a key path too long");
    skip_space(r);
    if (r->at < r->len && r->s[r->at] == '{')
        return object(r, path, depth + 1);
    if (r->out->n == FLAT_JSON_MAX)
        return fail(r, "too many values");
    flat_json_field *f = &r->out->fields[r->out->n];
    snprintf(f->path, sizeof f->path, "%s", path);
    if (r->at < r->len && r->s[r->at] == '"') {
        f->is_string = 1;
        if (string(r, f->value, sizeof f->value) != 0)
            return -1;
    } else {
        size_t start = r->at, k = 0;
        if (r->at < r->len && r->s[r->at] == '-')
            r->at++;
        size_t digits = r->at;
        while (r->at < r->len && r->s[r->at] >= '0' && r->s[r->at] <= '9')
            r->at++;
        if (r->at == digits || r->at - start >= sizeof f->value)
            return fail(r, "expected a string, an integer or an object");
        for (size_t i = start; i < r->at; i++)
            f->value[k++] = r->s[i];
        f->value[k] = '\0';
        f->is_string = 0;
    }
    r->out->n++;
    return 0;
}

static int object(reader *r, const char *prefix, int depth)
{
    if (depth > 4)
        return fail(r, "objects nested too deep");
    if (expect(r, '{') != 0)
        return -1;
    skip_space(r);
    if (r->at < r->len && r->s[r->at] == '}') {
        r->at++;
        return 0;
    }
    for (;;) {
        if (member(r, prefix, depth) != 0)
            return -1;
        skip_space(r);
        if (r->at < r->len && r->s[r->at] == ',') {
            r->at++;
            continue;
        }
        return expect(r, '}');
    }
}

int flat_json_parse(const char *text, size_t len, flat_json *out, char *err, size_t err_size)
{
    reader r = {.s = text, .len = len, .out = out, .err = err, .err_size = err_size};
    out->n = 0;
    if (object(&r, "", 0) != 0)
        return -1;
    skip_space(&r);
    if (r.at != len)
        return fail(&r, "text after the end");
    return 0;
}

const flat_json_field *flat_json_get(const flat_json *j, const char *path)
{
    for (int i = 0; i < j->n; i++)
        if (strcmp(j->fields[i].path, path) == 0)
            return &j->fields[i];
    return NULL;
}
