/* The export's output directory: written as a hidden temporary sibling and renamed into place,
 * so a reader sees the whole directory or none (rename of a directory is one step). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lib/core/error.h"
#include "lib/hf/export_internal.h"

kt_status kt__path_join(char *buf, size_t size, const char *dir, const char *name)
{
    int n = snprintf(buf, size, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= size)
        return kt__error(KT_EINVAL, "%s/%s: path too long", dir, name);
    return KT_OK;
}

int kt__path_exists(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0;
}

/* The parent directory of path ("." for a bare name) and its last component. */
static kt_status split_path(const char *path, char *parent, char *base, size_t size)
{
    size_t len = strlen(path);
    while (len > 1 && path[len - 1] == '/')
        len--;
    if (len == 0 || len >= size)
        return kt__error(KT_EINVAL, "'%s': not a usable output directory name", path);
    const char *slash = NULL;
    for (size_t i = 0; i < len; i++)
        if (path[i] == '/')
            slash = path + i;
    if (slash == NULL) {
        strcpy(parent, ".");
        memcpy(base, path, len);
        base[len] = '\0';
    } else {
        size_t plen = slash == path ? 1 : (size_t)(slash - path);
        memcpy(parent, path, plen);
        parent[plen] = '\0';
        size_t blen = len - (size_t)(slash + 1 - path);
        memcpy(base, slash + 1, blen);
        base[blen] = '\0';
    }
    if (base[0] == '\0' || strcmp(base, ".") == 0 || strcmp(base, "..") == 0 ||
        strcmp(base, "/") == 0)
        return kt__error(KT_EINVAL, "'%s': not a usable output directory name", path);
    return KT_OK;
}

kt_status kt__xdir_begin(kt__xdir *d, const char *out_dir)
{
    memset(d, 0, sizeof *d);
    char parent[KT_HF_EXPORT_PATH_BYTES], base[KT_HF_EXPORT_PATH_BYTES];
    KT__TRY(split_path(out_dir, parent, base, sizeof parent));
    if (kt__path_exists(out_dir))
        return kt__error(KT_EINVAL, "%s: already exists (the export writes a new directory; "
                                    "remove it or choose another)",
                         out_dir);
    struct stat st;
    if (stat(parent, &st) != 0 || !S_ISDIR(st.st_mode))
        return kt__error(KT_EIO, "%s: the directory '%s' it would go in does not exist", out_dir,
                         parent);
    int n = snprintf(d->final, sizeof d->final, "%s", out_dir);
    int m = snprintf(d->tmp, sizeof d->tmp, "%s/.%s.kt-tmp.%ld", parent, base, (long)getpid());
    if (n < 0 || (size_t)n >= sizeof d->final || m < 0 || (size_t)m >= sizeof d->tmp)
        return kt__error(KT_EINVAL, "%s: path too long", out_dir);
    /* a temporary of this PID left by a killed earlier run: ours to replace */
    if (kt__path_exists(d->tmp)) {
        d->created = 1;
        kt__xdir_abort(d);
    }
    if (mkdir(d->tmp, 0777) != 0)
        return kt__error(KT_EIO, "%s: cannot create the temporary directory %s: %s", out_dir,
                         d->tmp, strerror(errno));
    d->created = 1;
    return KT_OK;
}

kt_status kt__xdir_path(const kt__xdir *d, const char *name, char *buf, size_t size)
{
    return kt__path_join(buf, size, d->tmp, name);
}

static void sync_dir(const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        (void)fsync(fd);
        close(fd);
    }
}

kt_status kt__xdir_commit(kt__xdir *d)
{
    char parent[KT_HF_EXPORT_PATH_BYTES], base[KT_HF_EXPORT_PATH_BYTES];
    KT__TRY(split_path(d->final, parent, base, sizeof parent));
    sync_dir(d->tmp);
    /* checked again: rename would replace an empty directory made meanwhile */
    if (kt__path_exists(d->final))
        return kt__error(KT_EINVAL, "%s: appeared while the export was written", d->final);
    if (rename(d->tmp, d->final) != 0)
        return kt__error(KT_EIO, "%s: cannot rename %s into place: %s", d->final, d->tmp,
                         strerror(errno));
    d->created = 0;
    sync_dir(parent);
    return KT_OK;
}

void kt__xdir_abort(kt__xdir *d)
{
    if (!d->created)
        return;
    DIR *dir = opendir(d->tmp);
    if (dir != NULL) {
        struct dirent *e;
        char path[KT_HF_EXPORT_PATH_BYTES + 256];
        while ((e = readdir(dir)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
                continue;
            if (snprintf(path, sizeof path, "%s/%s", d->tmp, e->d_name) < (int)sizeof path)
                (void)unlink(path);
        }
        closedir(dir);
    }
    (void)rmdir(d->tmp);
    d->created = 0;
}

kt_status kt__read_text(const char *path, size_t max_bytes, char **text_out, size_t *len_out)
{
    *text_out = NULL;
    int fd = -1, regular = 0;
    KT__TRY(kt_in_open(path, &fd, &regular));
    kt_status status = KT_OK;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap + 1);
    if (buf == NULL) {
        status = kt__error(KT_ENOMEM, "%s: out of memory", path);
        goto out;
    }
    for (;;) {
        if (len == cap) {
            if (cap >= max_bytes) {
                status = kt__error(KT_EFORMAT, "%s: larger than %zu bytes", path, max_bytes);
                goto out;
            }
            cap *= 2;
            char *grown = realloc(buf, cap + 1);
            if (grown == NULL) {
                status = kt__error(KT_ENOMEM, "%s: out of memory", path);
                goto out;
            }
            buf = grown;
        }
        ssize_t got = read(fd, buf + len, cap - len);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0) {
            status = kt__error(KT_EIO, "%s: cannot read: %s", path, strerror(errno));
            goto out;
        }
        if (got == 0)
            break;
        len += (size_t)got;
    }
    if (len > max_bytes) {
        status = kt__error(KT_EFORMAT, "%s: larger than %zu bytes", path, max_bytes);
        goto out;
    }
    buf[len] = '\0';
    *text_out = buf;
    *len_out = len;
    buf = NULL;
out:
    free(buf);
    close(fd);
    return status;
}

kt_status kt__copy_file(const char *src, const char *dst)
{
    int fd = -1, regular = 0;
    KT__TRY(kt_in_open(src, &fd, &regular));
    kt_out_file *out = NULL;
    kt_status status = kt_out_open(dst, &out);
    char *buf = status == KT_OK ? malloc(1 << 16) : NULL;
    if (status == KT_OK && buf == NULL)
        status = kt__error(KT_ENOMEM, "%s: out of memory", src);
    while (status == KT_OK) {
        ssize_t got = read(fd, buf, 1 << 16);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            status = kt__error(KT_EIO, "%s: cannot read: %s", src, strerror(errno));
        else if (got == 0)
            break;
        else
            status = kt_out_write(out, buf, (size_t)got);
    }
    if (status == KT_OK) {
        status = kt_out_commit(out);
        out = NULL;
    }
    kt_out_discard(out);
    free(buf);
    close(fd);
    return status;
}
