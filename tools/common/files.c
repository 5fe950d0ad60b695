#include "tools/common/files.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kt/io.h"
#include "tools/common/usage.h"

int tool_open_input(const char *tool, const char *what, const char *path, int *fd_out)
{
    if (kt_in_open(path, fd_out, NULL) != KT_OK) {
        fprintf(stderr, "%s: cannot read %s: %s\n", tool, what, kt_last_error());
        return 1;
    }
    return 0;
}

/* Where a path leads: the file itself when it exists, else its directory and its name (a file
 * not yet created is "the same" as another only by that). */
typedef struct identity {
    int known, exists;
    dev_t dev;
    ino_t ino;
    const char *name; /* the last component, when !exists */
} identity;

static identity identify(const char *path)
{
    identity id = {0};
    struct stat st;
    if (stat(path, &st) == 0) {
        id.known = id.exists = 1;
        id.dev = st.st_dev;
        id.ino = st.st_ino;
        return id;
    }
    if (errno != ENOENT)
        return id;
    const char *slash = strrchr(path, '/');
    id.name = slash != NULL ? slash + 1 : path;
    size_t dlen = slash == NULL ? 0 : slash == path ? 1 : (size_t)(slash - path);
    char *dir = malloc(dlen + 2);
    if (dir == NULL)
        return id;
    memcpy(dir, slash == NULL ? "." : path, slash == NULL ? 1 : dlen);
    dir[slash == NULL ? 1 : dlen] = '\0';
    if (stat(dir, &st) == 0 && *id.name != '\0') {
        id.known = 1;
        id.dev = st.st_dev;
        id.ino = st.st_ino;
    }
    free(dir);
    return id;
}

static int same(const identity *a, const identity *b)
{
    return a->known && b->known && a->exists == b->exists && a->dev == b->dev &&
           a->ino == b->ino && (a->exists || strcmp(a->name, b->name) == 0);
}

int tool_check_paths(const char *tool, const tool_path *entries, int n)
{
    for (int i = 0; i < n; i++) {
        if (!entries[i].is_output || entries[i].path == NULL)
            continue;
        identity out = identify(entries[i].path);
        for (int j = 0; j < n; j++) {
            /* a pair of outputs is reported once, at the later one */
            if (j == i || entries[j].path == NULL || (entries[j].is_output && j > i))
                continue;
            identity other = identify(entries[j].path);
            if (!same(&out, &other))
                continue;
            return kt_tool_usage_error(tool, "%s names the same file as %s (%s): %s",
                                       entries[i].option, entries[j].option, entries[j].path,
                                       entries[j].is_output
                                           ? "two outputs must not share a file"
                                           : "an output must not overwrite an input");
        }
    }
    return 0;
}

int tool_probe_output(const char *tool, const char *what, const char *path)
{
    kt_out_file *f = NULL;
    if (path == NULL)
        return 0;
    if (kt_out_open(path, &f) != KT_OK) {
        fprintf(stderr, "%s: cannot write %s: %s\n", tool, what, kt_last_error());
        return 1;
    }
    kt_out_discard(f); /* the target is left as it was */
    return 0;
}

int tool_probe_safetensors(const char *tool, const char *what, const char *path)
{
    kt_st_file *f = NULL;
    if (path == NULL)
        return 0;
    if (kt_st_open(path, &f) != KT_OK) {
        fprintf(stderr, "%s: cannot read %s: %s\n", tool, what, kt_last_error());
        return 1;
    }
    kt_st_close(f);
    return 0;
}
