/* The decode program: a compiled .ktp as it is, or a .ktg description compiled here, forward
 * only, with the -D overrides (so that one command line sets the context C and the model's
 * sizes, as kt-graphc would) and NEW, the tokens a step, set by kt-generate: 1 for the decode
 * steps, the prompt's length less one for the prefill. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tools/common/files.h"
#include "tools/kt-generate/generate.h"

/* A description is a few kilobytes; more is not one (a binary named by mistake). */
#define MAX_SOURCE_BYTES (16u << 20)
#define DIAG_BYTES (64u * 1024u)

int gen_is_description(const char *path)
{
    size_t n = strlen(path);
    return n >= 4 && strcmp(path + n - 4, ".ktg") == 0;
}

int64_t gen_program_context(const kt_program *p)
{
    for (int i = 0; i < kt_program_count(p, KT_ROLE_INPUT); i++) {
        const char *name = "";
        kt_tensor meta;
        if (kt_program_tensor_info(p, KT_ROLE_INPUT, i, &name, &meta) == KT_OK &&
            strcmp(name, "segments") == 0 && meta.ndim == 2)
            return meta.shape[1];
    }
    return 0;
}

/* The whole file, NUL-terminated; NULL after printing why. */
static char *read_source(const char *path, size_t *len_out)
{
    int fd;
    if (tool_open_input(GEN_TOOL, "the model description", path, &fd) != 0)
        return NULL;
    size_t cap = 1u << 16, len = 0;
    char *buf = malloc(cap);
    while (buf != NULL) {
        ssize_t got = read(fd, buf + len, cap - 1 - len);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0) {
            gen_error("cannot read '%s': %s", path, strerror(errno));
            free(buf);
            close(fd);
            return NULL;
        }
        if (got == 0)
            break;
        len += (size_t)got;
        if (len + 1 < cap)
            continue;
        if (cap >= MAX_SOURCE_BYTES) {
            gen_error("'%s' is larger than %u MiB: not a model description", path,
                      MAX_SOURCE_BYTES >> 20);
            free(buf);
            close(fd);
            return NULL;
        }
        char *grown = realloc(buf, cap * 2);
        if (grown == NULL)
            free(buf);
        buf = grown;
        cap *= 2;
    }
    close(fd);
    if (buf == NULL) {
        gen_error("out of memory reading '%s'", path);
        return NULL;
    }
    buf[len] = '\0';
    *len_out = len;
    return buf;
}

static int compile_description(const char *path, const kt_ktg_define *user, int n_user,
                               int64_t n_new, kt_program **program_out)
{
    kt_ktg_define defines[GEN_MAX_DEFINES + 1];
    int n_defines = 0;
    for (int i = 0; i < n_user; i++) {
        if (strcmp(user[i].name, "NEW") == 0)
            return kt_tool_usage_error(GEN_TOOL, "-D NEW: kt-generate sets the tokens a step "
                                       "itself (1, and the prompt's length less one to take "
                                       "the prompt in one forward)");
        defines[n_defines++] = user[i];
    }
    if (n_new > 0)
        defines[n_defines++] = (kt_ktg_define){"NEW", n_new};
    size_t len;
    char *text = read_source(path, &len);
    if (text == NULL)
        return 1;
    char *diag = malloc(DIAG_BYTES);
    if (diag == NULL) {
        free(text);
        return gen_error("out of memory");
    }
    kt_graph *g = NULL;
    int n_errors = 0;
    kt_status st = kt_ktg_parse(text, len, path, defines, n_defines, &g, diag, DIAG_BYTES,
                                &n_errors);
    free(text);
    if (st != KT_OK) {
        fputs(diag, stderr);
        free(diag);
        return gen_error("%s: %d error%s", path, n_errors, n_errors == 1 ? "" : "s");
    }
    free(diag);
    const kt_compile_options opts = {.training = 0};
    st = kt_compile(g, &opts, program_out);
    kt_graph_destroy(g);
    if (st != KT_OK)
        return gen_error("%s: compiling failed: %s", path, kt_last_error());
    return 0;
}

int gen_program_load(const char *path, const kt_ktg_define *defines, int n_defines,
                     int64_t n_new, kt_program **program_out)
{
    *program_out = NULL;
    if (gen_is_description(path))
        return compile_description(path, defines, n_defines, n_new, program_out);
    if (n_defines > 0)
        return kt_tool_usage_error(GEN_TOOL, "-D %s: overrides apply to a .ktg description, "
                                   "and %s is a compiled program (compile it again with "
                                   "kt-graphc -D, or give the .ktg)", defines[0].name, path);
    if (kt_program_load(path, program_out) != KT_OK)
        return gen_error("cannot load the program: %s", kt_last_error());
    return 0;
}
