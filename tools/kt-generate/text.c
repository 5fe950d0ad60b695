/* Prompts in, tokens out. Without a tokenizer a token is a byte (kt-train's u8 data, kt-data's
 * "bytes"): the prompt's bytes are its ids, and a generated id below 256 prints as its byte,
 * escaped unless it is printable ASCII, a newline or a tab (so the output stays text), an id
 * from 256 up as \{ID}. With --ids the ids print as a comma-separated list, as --prompt-ids
 * takes them. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "tools/common/usage.h"
#include "tools/kt-generate/generate.h"

int gen_parse_ids(const char *list, int64_t **ids_out, int64_t *n_out)
{
    size_t cap = 1;
    for (const char *c = list; *c; c++)
        cap += *c == ',';
    int64_t *ids = malloc(cap * sizeof *ids);
    if (ids == NULL)
        return gen_error("out of memory");
    int64_t n = 0;
    const char *c = list;
    for (;;) {
        char *end = NULL;
        errno = 0;
        long long v = *c >= '0' && *c <= '9' ? strtoll(c, &end, 10) : -1;
        if (v < 0 || errno != 0 || (*end != ',' && *end != '\0')) {
            free(ids);
            return kt_tool_usage_error(GEN_TOOL, "--prompt-ids needs token ids >= 0 separated "
                                       "by commas (1,2,3), not '%s'", list);
        }
        ids[n++] = v;
        if (*end == '\0')
            break;
        c = end + 1;
    }
    *ids_out = ids;
    *n_out = n;
    return 0;
}

int gen_text_ids(const char *text, int64_t **ids_out, int64_t *n_out)
{
    const size_t n = strlen(text);
    int64_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (ids == NULL)
        return gen_error("out of memory");
    for (size_t i = 0; i < n; i++)
        ids[i] = (unsigned char)text[i];
    *ids_out = ids;
    *n_out = (int64_t)n;
    return 0;
}

void gen_print_token(FILE *f, int64_t id, int as_ids, int64_t index)
{
    if (as_ids)
        fprintf(f, index > 0 ? ",%lld" : "%lld", (long long)id);
    else if (id >= 256)
        fprintf(f, "\\{%lld}", (long long)id);
    else if (id == '\\')
        fputs("\\\\", f);
    else if ((id >= 0x20 && id < 0x7f) || id == '\n' || id == '\t')
        fputc((int)id, f);
    else
        fprintf(f, "\\x%02x", (unsigned)id);
}
