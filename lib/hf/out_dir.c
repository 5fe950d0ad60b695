/* OUT written whole or not at all: the files go to a temporary sibling directory, which is
 * renamed onto OUT at the end. An empty OUT is replaced by that one rename; an OUT holding an
 * earlier import's files is swapped with the new one in one step where the system can
 * (Linux's renameat2 RENAME_EXCHANGE), else renamed aside first, then removed. Anything else
 * at OUT is refused before anything is written, so no user file is ever deleted. */
#if defined(__linux__)
#define _GNU_SOURCE /* renameat2 */
#endif
#include "lib/hf/out_dir.h"

#include <fcntl.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lib/core/error.h"

static const char *const known[] = {"model.ktg", "model.ktp", "model_decode.ktg", "import.json"};
#define N_KNOWN (sizeof known / sizeof known[0])

static int is_known(const char *name)
{
    for (size_t i = 0; i < N_KNOWN; i++)
        if (strcmp(name, known[i]) == 0)
            return 1;
    return 0;
}

/* KT_OK when dir holds only kt-import's files (*empty_out: none at all). */
static kt_status check_existing(const char *dir, int *empty_out)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return kt__error(KT_EIO, "%s: cannot read the existing output directory: %s", dir,
                         strerror(errno));
    kt_status s = KT_OK;
    int empty = 1;
    struct dirent *ent;
    while ((ent = readdir(d)) != NULL) {
        if (strcmp(ent->d_name, ".") == 0 || strcmp(ent->d_name, "..") == 0)
            continue;
        empty = 0;
        if (!is_known(ent->d_name)) {
            s = kt__error(KT_EINVAL, "%s exists and holds '%s', which kt-import did not "
                          "write: not replaced (give an empty or new directory)", dir,
                          ent->d_name);
            break;
        }
    }
    closedir(d);
    *empty_out = empty;
    return s;
}

/* Removes kt-import's files from dir, then dir (only if nothing else is left). */
static void remove_dir(const char *dir)
{
    char path[4096];
    for (size_t i = 0; i < N_KNOWN; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, known[i]);
        unlink(path);
    }
    rmdir(dir);
}

kt_status kt__hf_out_begin(const char *out_dir, kt__hf_out *o)
{
    memset(o, 0, sizeof *o);
    size_t n = strlen(out_dir);
    while (n > 1 && out_dir[n - 1] == '/')
        n--; /* "out/" is "out" */
    if (n == 0 || n > 3000)
        return kt__error(KT_EINVAL, "kt_hf_import: output directory '%s': empty or too long",
                         out_dir);
    snprintf(o->out, sizeof o->out, "%.*s", (int)n, out_dir);
    const char *slash = strrchr(o->out, '/');
    const char *base = slash ? slash + 1 : o->out;
    int parent_len = slash ? (int)(slash - o->out) + 1 : 0;
    if (strcmp(base, ".") == 0 || strcmp(base, "..") == 0)
        return kt__error(KT_EINVAL, "kt_hf_import: output directory '%s': name a directory, "
                         "not '%s'", out_dir, base);
    struct stat st;
    o->existed = 0;
    if (lstat(o->out, &st) == 0) {
        if (!S_ISDIR(st.st_mode))
            return kt__error(KT_EINVAL, "%s exists and is not a directory: not replaced",
                             o->out);
        int empty = 1;
        KT__TRY(check_existing(o->out, &empty));
        o->existed = !empty;
    } else if (errno != ENOENT) {
        return kt__error(KT_EIO, "%s: %s", o->out, strerror(errno));
    }
    snprintf(o->tmp, sizeof o->tmp, "%.*s.%s.kt-import-tmp.%ld", parent_len, o->out, base,
             (long)getpid());
    snprintf(o->old, sizeof o->old, "%.*s.%s.kt-import-old.%ld", parent_len, o->out, base,
             (long)getpid());
    remove_dir(o->tmp); /* left by a killed run of this same pid number */
    if (mkdir(o->tmp, 0777) != 0) {
        kt_status s = kt__error(errno == ENOENT ? KT_EINVAL : KT_EIO,
                                "%s: cannot create the output next to it: %s", o->out,
                                errno == ENOENT ? "its parent directory does not exist"
                                                : strerror(errno));
        o->tmp[0] = '\0';
        return s;
    }
    return KT_OK;
}

void kt__hf_out_path(const kt__hf_out *o, const char *file, char *buf, size_t size)
{
    snprintf(buf, size, "%s/%s", o->tmp, file);
}

kt_status kt__hf_out_commit(kt__hf_out *o)
{
    if (!o->existed) {
        /* a new name, or an empty directory rename() replaces in one step */
        if (rename(o->tmp, o->out) != 0) {
            kt_status s = kt__error(KT_EIO, "%s: cannot move the output into place: %s",
                                    o->out, strerror(errno));
            kt__hf_out_abort(o);
            return s;
        }
        o->tmp[0] = '\0';
        return KT_OK;
    }
#if defined(__linux__) && defined(RENAME_EXCHANGE)
    /* one step: OUT is the new import, the temporary name the earlier one */
    if (renameat2(AT_FDCWD, o->tmp, AT_FDCWD, o->out, RENAME_EXCHANGE) == 0) {
        remove_dir(o->tmp);
        o->tmp[0] = '\0';
        return KT_OK;
    }
#endif
    if (rename(o->out, o->old) != 0) {
        kt_status s = kt__error(KT_EIO, "%s: cannot move the earlier import aside: %s", o->out,
                                strerror(errno));
        kt__hf_out_abort(o);
        return s;
    }
    if (rename(o->tmp, o->out) != 0) {
        kt_status s = kt__error(KT_EIO, "%s: cannot move the output into place: %s", o->out,
                                strerror(errno));
        if (rename(o->old, o->out) != 0) /* put the earlier import back */
            s = kt__error(KT_EIO, "%s: cannot move the output into place, and the earlier "
                          "import stays at %s: %s", o->out, o->old, strerror(errno));
        kt__hf_out_abort(o);
        return s;
    }
    o->tmp[0] = '\0';
    remove_dir(o->old);
    return KT_OK;
}

void kt__hf_out_abort(kt__hf_out *o)
{
    if (o->tmp[0] != '\0')
        remove_dir(o->tmp);
    o->tmp[0] = '\0';
}
