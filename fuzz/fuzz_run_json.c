/* libFuzzer target: kt-train's reader of its run.json (tools/kt-train/flat_json.c).
 *
 * The input is the file's text. When it is accepted, every field must have a NUL-terminated
 * path and value within their buffers, and flat_json_get must find each path again (the first
 * field of that path); when it is refused, the message must be set. A broken invariant aborts. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tools/kt-train/flat_json.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static flat_json j; /* 60 KB: not on the stack */
    char err[256];
    err[0] = '\0';
    if (flat_json_parse((const char *)data, size, &j, err, sizeof err) != 0) {
        if (err[0] == '\0' || memchr(err, '\0', sizeof err) == NULL)
            abort();
        return 0;
    }
    if (j.n < 0 || j.n > FLAT_JSON_MAX)
        abort();
    for (int i = 0; i < j.n; i++) {
        const flat_json_field *f = &j.fields[i];
        if (memchr(f->path, '\0', sizeof f->path) == NULL ||
            memchr(f->value, '\0', sizeof f->value) == NULL)
            abort();
        const flat_json_field *g = flat_json_get(&j, f->path);
        if (g == NULL || strcmp(g->path, f->path) != 0)
            abort();
    }
    return 0;
}
