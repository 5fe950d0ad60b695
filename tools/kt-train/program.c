/* The program kt-train trains: a compiled .ktp, or a .ktg model description compiled here, as
 * kt-graphc would (its own checkpoint policy, training when it has a loss), with the -D
 * overrides of the command line (kt-train model.ktg -D B=8 -D T=256). Either way it is
 * serialised once: each checkpoint stores those bytes, and their hash says on --resume whether
 * the program is the same. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "tools/kt-train/trainer.h"

/* A model description is a few kilobytes; a larger file is not one. */
#define MAX_KTG_BYTES (64u << 20)

uint64_t hash_bytes(uint64_t h, const void *data, size_t n)
{
    const unsigned char *b = data;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) { /* 8-byte words: a few GB/s over a checkpoint */
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = (h ^ w) * 0x100000001b3ull;
    }
    for (; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static int is_ktg(const char *path)
{
    size_t n = strlen(path);
    return n > 4 && strcmp(path + n - 4, ".ktg") == 0;
}

static char *read_text(const char *path, size_t *len_out)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        train_error("cannot open the model %s: %s", path, strerror(errno));
        return NULL;
    }
    char *buf = malloc(MAX_KTG_BYTES + 1);
    size_t len = buf != NULL ? fread(buf, 1, MAX_KTG_BYTES + 1, f) : 0;
    int failed = buf == NULL || ferror(f);
    fclose(f);
    if (failed || len > MAX_KTG_BYTES) {
        train_error(failed ? "cannot read the model %s" : "%s is larger than 64 MiB: not a "
                    "model description", path);
        free(buf);
        return NULL;
    }
    *len_out = len;
    return buf;
}

static int compile_ktg(trainer *t, const train_args *a)
{
    size_t len;
    char *text = read_text(a->program, &len);
    if (text == NULL)
        return 1;
    enum { DIAG_BYTES = 64 * 1024 };
    char *diag = malloc(DIAG_BYTES);
    if (diag == NULL) {
        free(text);
        return train_fail("out of memory", NULL);
    }
    kt_graph *g = NULL;
    int n_errors = 0;
    kt_status st = kt_ktg_parse(text, len, a->program, a->defines, a->n_defines, &g, diag,
                                DIAG_BYTES, &n_errors);
    free(text);
    if (st != KT_OK) {
        fputs(diag, stderr); /* every diagnostic, as kt-graphc prints them */
        free(diag);
        return train_error("%s: %d error%s in the model description", a->program, n_errors,
                           n_errors == 1 ? "" : "s");
    }
    free(diag);
    kt_compile_options co = {.training = kt_graph_has_loss(g)};
    st = kt_compile(g, &co, &t->p);
    kt_graph_destroy(g);
    if (st != KT_OK)
        return train_error("%s: compiling failed: %s", a->program, kt_last_error());
    return 0;
}

int program_open(trainer *t, const train_args *a)
{
    if (is_ktg(a->program)) {
        if (compile_ktg(t, a) != 0)
            return 1;
    } else if (kt_program_load(a->program, &t->p) != KT_OK) {
        return train_fail("cannot load the program", kt_last_error());
    }
    kt_program_stats st;
    kt_program_get_stats(t->p, &st);
    if (st.n_backward_steps == 0)
        return train_error("%s has no loss (or was compiled with --forward-only): there is "
                           "nothing to train", a->program);
    if (kt_program_serialized_size(t->p, &t->program_size) != KT_OK ||
        (t->program_bytes = malloc(t->program_size)) == NULL ||
        kt_program_serialize(t->p, t->program_bytes, t->program_size) != KT_OK)
        return train_fail("cannot serialise the program", kt_last_error());
    t->program_hash = hash_bytes(HASH_START, t->program_bytes, t->program_size);
    return 0;
}
