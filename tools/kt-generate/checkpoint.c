/* Which file --params names: a safetensors file or a Hugging Face directory as it is (kt_st_open
 * reads those), a kt-train checkpoint directory (step-NNNNNNNN/, its session.safetensors), or
 * a kt-train run directory (its newest step-NNNNNNNN/ checkpoint; the names sort by step). */
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tools/kt-generate/generate.h"

#define SESSION_FILE "session.safetensors"

static int is_file(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static char *joined(const char *dir, const char *a, const char *b)
{
    size_t n = strlen(dir) + strlen(a) + strlen(b) + 3;
    char *s = malloc(n);
    if (s != NULL)
        snprintf(s, n, "%s/%s%s%s", dir, a, *b ? "/" : "", b);
    return s;
}

/* A kt-train checkpoint's directory name: step- and digits only. */
static int is_step_name(const char *name)
{
    if (strncmp(name, "step-", 5) != 0 || name[5] == '\0')
        return 0;
    for (const char *c = name + 5; *c; c++)
        if (*c < '0' || *c > '9')
            return 0;
    return 1;
}

int gen_checkpoint_path(const char *params, char **path_out)
{
    struct stat st;
    *path_out = NULL;
    if (stat(params, &st) != 0 || !S_ISDIR(st.st_mode))
        return 0;
    char *own = joined(params, SESSION_FILE, "");
    if (own == NULL)
        return gen_error("out of memory");
    if (is_file(own)) {
        *path_out = own;
        return 0;
    }
    free(own);
    DIR *dir = opendir(params);
    if (dir == NULL)
        return 0; /* kt_st_open says why */
    char newest[256] = "";
    for (struct dirent *e; (e = readdir(dir)) != NULL;) {
        if (!is_step_name(e->d_name) || strlen(e->d_name) >= sizeof newest)
            continue;
        /* the same width (8 digits) sorts by step; a longer number is a later step */
        const size_t a = strlen(e->d_name), b = strlen(newest);
        if (a > b || (a == b && strcmp(e->d_name, newest) > 0)) {
            char *file = joined(params, e->d_name, SESSION_FILE);
            if (file == NULL) {
                closedir(dir);
                return gen_error("out of memory");
            }
            if (is_file(file))
                strcpy(newest, e->d_name);
            free(file);
        }
    }
    closedir(dir);
    if (newest[0] != '\0' && (*path_out = joined(params, newest, SESSION_FILE)) == NULL)
        return gen_error("out of memory");
    return 0;
}
