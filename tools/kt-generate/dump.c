/* --dump-logits: every forward's logits with the token fed, kept in memory and written at the
 * end as one safetensors file ("logits" f32 [steps, VOCAB], "tokens" i32 [steps]) through
 * kt_st_save, so a failed run leaves no file and a good one a whole file. */
#include <stdlib.h>
#include <string.h>

#include "tools/kt-generate/generate.h"

int gen_logit_row(void *ctx, int64_t token, const float *logits)
{
    gen_logit_log *g = ctx;
    if (g->n == g->cap) {
        const int64_t cap = g->cap ? 2 * g->cap : 64;
        float *rows = realloc(g->rows, (size_t)(cap * g->vocab) * sizeof *rows);
        if (rows != NULL)
            g->rows = rows;
        int32_t *tokens = realloc(g->tokens, (size_t)cap * sizeof *tokens);
        if (tokens != NULL)
            g->tokens = tokens;
        if (rows == NULL || tokens == NULL)
            return gen_error("out of memory (--dump-logits)");
        g->cap = cap;
    }
    memcpy(g->rows + g->n * g->vocab, logits, (size_t)g->vocab * sizeof *logits);
    g->tokens[g->n++] = (int32_t)token;
    return 0;
}

int gen_logit_save(const gen_logit_log *g, const char *path)
{
    kt_st_item items[2] = {{.name = "logits"}, {.name = "tokens"}};
    const int64_t shape[2] = {g->n, g->vocab};
    if (kt_tensor_init(&items[0].tensor, g->rows, KT_F32, 2, shape) != KT_OK ||
        kt_tensor_init(&items[1].tensor, g->tokens, KT_I32, 1, shape) != KT_OK ||
        kt_st_save(path, items, 2, NULL) != KT_OK)
        return gen_error("cannot write the logits: %s", kt_last_error());
    return 0;
}

void gen_logit_free(gen_logit_log *g)
{
    free(g->rows);
    free(g->tokens);
    memset(g, 0, sizeof *g);
}
