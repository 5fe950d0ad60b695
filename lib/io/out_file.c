/* Output files written whole or not at all (include/kt/io.h): a temporary in the target's
 * directory, synced, then renamed over the target.
 *
 * Linux-specific parts, each with a fallback: O_TMPFILE (the temporary has no name until the
 * commit, so kill -9 leaves nothing), linking it in through /proc/self/fd, and the umask read
 * from /proc/self/status (umask() itself cannot be read without changing it for every
 * thread). */
#define _GNU_SOURCE
#include "kt/io.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lib/core/error.h"
#include "lib/io/out_file.h"

/* Text from kt_out_printf is gathered here so that a trace of many small records does not
 * cost a system call each. */
#define OUT_BUF 65536
/* The part of the target's name a temporary's name repeats: NAME_MAX (255) must leave room
 * for the rest (".", ".kt-tmp.", a PID and a counter). */
#define BASE_SHOWN 200
#define TMP_TAG ".kt-tmp."

int kt__out_force_named;

struct kt_out_file {
    char *path;  /* as given, for messages */
    char *base;  /* the last component: the name in dirfd */
    char *tmp;   /* the temporary's name in dirfd once it has one */
    int dirfd;
    int fd;
    int named;   /* the temporary has a name (fallback, or linked in by commit) */
    int failed_errno; /* the first write failure, or 0 */
    mode_t mode;
    size_t len;  /* bytes waiting in buf */
    char buf[OUT_BUF];
};

static kt_status sys_error(int err, const char *path, const char *what)
{
    /* (strerror_r: _GNU_SOURCE, needed for O_TMPFILE, swaps in glibc's other one) */
    return kt__error(KT_EIO, "%s: %s: %s", path, what, strerror(err));
}

const char *kt__file_kind(mode_t m)
{
    if (S_ISLNK(m))
        return "a symbolic link";
    if (S_ISDIR(m))
        return "a directory";
    if (S_ISFIFO(m))
        return "a named FIFO";
    if (S_ISSOCK(m))
        return "a socket";
    if (S_ISCHR(m))
        return "a character device";
    if (S_ISBLK(m))
        return "a block device";
    return "not a regular file";
}

/* What an existing target allows: nothing but a regular file is ever replaced, so that an
 * output path naming a device, a link or a directory changes nothing. *exists_out and *mode_out
 * describe the file found. */
static kt_status check_target(int dirfd, const char *base, const char *path, int *exists_out,
                              mode_t *mode_out)
{
    struct stat st;
    if (fstatat(dirfd, base, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno != ENOENT)
            return sys_error(errno, path, "cannot inspect it");
        *exists_out = 0;
        return KT_OK;
    }
    if (!S_ISREG(st.st_mode))
        return kt__error(KT_EINVAL, "%s: is %s; an output is written only to a regular file or "
                         "a new name, so it is left as it is", path, kt__file_kind(st.st_mode));
    *exists_out = 1;
    *mode_out = st.st_mode & 07777;
    return KT_OK;
}

/* The process's umask as /proc/self/status reports it; 022 where it cannot be read. */
static mode_t current_umask(void)
{
    mode_t mask = 022;
    FILE *f = fopen("/proc/self/status", "re");
    if (f == NULL)
        return mask;
    char line[256];
    unsigned int v;
    while (fgets(line, sizeof line, f) != NULL)
        if (sscanf(line, "Umask: %o", &v) == 1) {
            mask = (mode_t)v & 0777;
            break;
        }
    fclose(f);
    return mask;
}

static int tmp_name(char *out, size_t cap, const char *base, long pid, unsigned int n)
{
    int w = snprintf(out, cap, ".%.*s" TMP_TAG "%ld.%u", BASE_SHOWN, base, pid, n);
    return w > 0 && (size_t)w < cap;
}

/* Removes temporaries of this target whose writer no longer runs: only the fallback leaves
 * them (and commit, killed between link and rename). Failures are not errors: the directory
 * may be shared, read-only to us, or cleaned concurrently. */
static void remove_stale(int dirfd, const char *base)
{
    char prefix[BASE_SHOWN + 16];
    snprintf(prefix, sizeof prefix, ".%.*s" TMP_TAG, BASE_SHOWN, base);
    size_t plen = strlen(prefix);
    int dup_fd = dup(dirfd);
    DIR *d = dup_fd >= 0 ? fdopendir(dup_fd) : NULL;
    if (d == NULL) {
        if (dup_fd >= 0)
            close(dup_fd);
        return;
    }
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (strncmp(e->d_name, prefix, plen) != 0)
            continue;
        char *end;
        errno = 0;
        long pid = strtol(e->d_name + plen, &end, 10);
        if (errno != 0 || end == e->d_name + plen || *end != '.' || pid <= 0)
            continue;
        char *end2;
        strtoul(end + 1, &end2, 10);
        if (end2 == end + 1 || *end2 != '\0')
            continue;
        if (kill((pid_t)pid, 0) != 0 && errno == ESRCH)
            unlinkat(dirfd, e->d_name, 0);
    }
    closedir(d);
}

/* Gives the temporary a fresh name in the directory: the fallback creates it so (O_EXCL),
 * commit links the unnamed one in (fd >= 0). A PID plus a per-process counter keeps
 * concurrent writers (threads or processes) apart. */
static kt_status name_temp(kt_out_file *f, int link_fd)
{
    static atomic_uint counter;
    char name[BASE_SHOWN + 64], proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", link_fd);
    for (int attempt = 0; attempt < 100; attempt++) {
        if (!tmp_name(name, sizeof name, f->base, (long)getpid(),
                      atomic_fetch_add(&counter, 1u)))
            return kt__error(KT_EINVAL, "%s: the name is too long", f->path);
        int ok;
        if (link_fd >= 0) {
            ok = linkat(AT_FDCWD, proc, f->dirfd, name, AT_SYMLINK_FOLLOW) == 0;
        } else {
            f->fd = openat(f->dirfd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, f->mode);
            ok = f->fd >= 0;
            /* the umask applies once more: a replaced file's own bits may lie outside it */
            if (ok && fchmod(f->fd, f->mode) != 0) {
                kt_status s = sys_error(errno, f->path, "cannot set the new file's mode");
                close(f->fd);
                f->fd = -1;
                unlinkat(f->dirfd, name, 0);
                return s;
            }
        }
        if (ok) {
            f->tmp = strdup(name);
            if (f->tmp == NULL) {
                unlinkat(f->dirfd, name, 0);
                return kt__error(KT_ENOMEM, "%s: out of memory", f->path);
            }
            f->named = 1;
            return KT_OK;
        }
        if (errno != EEXIST)
            return sys_error(errno, f->path, "cannot create a temporary file beside it");
    }
    return kt__error(KT_EIO, "%s: cannot find an unused temporary file name", f->path);
}

/* An unnamed temporary, where the filesystem has them and /proc can link one in later. */
static int open_unnamed(kt_out_file *f)
{
    if (kt__out_force_named || access("/proc/self/fd", X_OK) != 0)
        return -1;
    int fd = openat(f->dirfd, ".", O_TMPFILE | O_WRONLY | O_CLOEXEC, f->mode);
    /* the mode the kernel gives an O_TMPFILE differs between versions: set it */
    if (fd >= 0 && fchmod(fd, f->mode) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

static kt_status split_path(kt_out_file *f, const char *path, char **dir_out)
{
    const char *slash = strrchr(path, '/');
    const char *base = slash != NULL ? slash + 1 : path;
    if (*base == '\0' || strcmp(base, ".") == 0 || strcmp(base, "..") == 0)
        return kt__error(KT_EINVAL, "%s: names a directory, not a file", path);
    size_t dlen = slash == NULL ? 1 : slash == path ? 1 : (size_t)(slash - path);
    char *dir = malloc(dlen + 1);
    f->path = strdup(path);
    f->base = strdup(base);
    if (dir == NULL || f->path == NULL || f->base == NULL) {
        free(dir);
        return kt__error(KT_ENOMEM, "%s: out of memory", path);
    }
    memcpy(dir, slash == NULL ? "." : slash == path ? "/" : path, dlen);
    dir[dlen] = '\0';
    *dir_out = dir;
    return KT_OK;
}

static void release(kt_out_file *f)
{
    if (f->fd >= 0)
        close(f->fd);
    if (f->named)
        unlinkat(f->dirfd, f->tmp, 0);
    if (f->dirfd >= 0)
        close(f->dirfd);
    free(f->tmp);
    free(f->base);
    free(f->path);
    free(f);
}

kt_status kt_out_open(const char *path, kt_out_file **file_out)
{
    if (file_out != NULL)
        *file_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    if (path == NULL || file_out == NULL)
        return kt__error(KT_EINVAL, "kt_out_open: NULL argument");
    if (*path == '\0')
        return kt__error(KT_EINVAL, "kt_out_open: the path is empty");
    kt_out_file *f = calloc(1, sizeof *f);
    if (f == NULL)
        return kt__error(KT_ENOMEM, "%s: out of memory", path);
    f->dirfd = f->fd = -1;
    char *dir = NULL;
    int exists = 0;
    kt_status s = split_path(f, path, &dir);
    if (s != KT_OK)
        goto done;
    f->dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (f->dirfd < 0) {
        char what[64 + BASE_SHOWN];
        snprintf(what, sizeof what, "cannot open its directory '%.*s'", BASE_SHOWN, dir);
        s = sys_error(errno, path, what);
        goto done;
    }
    s = check_target(f->dirfd, f->base, path, &exists, &f->mode);
    if (s != KT_OK)
        goto done;
    if (!exists)
        f->mode = 0666 & ~current_umask();
    remove_stale(f->dirfd, f->base);
    f->fd = open_unnamed(f);
    if (f->fd < 0)
        s = name_temp(f, -1);
done:
    free(dir);
    if (s != KT_OK) {
        release(f);
        return s;
    }
    *file_out = f;
    return KT_OK;
}

static int write_fd(int fd, const void *p, size_t n)
{
    const unsigned char *b = p;
    while (n > 0) {
        /* Linux writes at most about 2 GiB per call; asking for less keeps that portable. */
        size_t chunk = n < ((size_t)1 << 30) ? n : ((size_t)1 << 30);
        ssize_t w = write(fd, b, chunk);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return errno;
        if (w == 0)
            return EIO; /* not seen on Linux, but it would otherwise loop forever */
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

static kt_status write_failed(kt_out_file *f, int err)
{
    if (f->failed_errno == 0)
        f->failed_errno = err;
    return sys_error(err, f->path, "cannot write");
}

static kt_status flush(kt_out_file *f)
{
    if (f->failed_errno != 0)
        return sys_error(f->failed_errno, f->path, "cannot write");
    int err = write_fd(f->fd, f->buf, f->len);
    f->len = 0;
    return err != 0 ? write_failed(f, err) : KT_OK;
}

kt_status kt_out_write(kt_out_file *f, const void *data, size_t n)
{
    if (f == NULL || (data == NULL && n > 0))
        return kt__error(KT_EINVAL, "kt_out_write: NULL argument");
    if (f->failed_errno != 0)
        return sys_error(f->failed_errno, f->path, "cannot write");
    if (n <= OUT_BUF - f->len) {
        if (n > 0)
            memcpy(f->buf + f->len, data, n);
        f->len += n;
        return KT_OK;
    }
    KT__TRY(flush(f));
    int err = write_fd(f->fd, data, n);
    return err != 0 ? write_failed(f, err) : KT_OK;
}

kt_status kt_out_printf(kt_out_file *f, const char *fmt, ...)
{
    if (f == NULL || fmt == NULL)
        return kt__error(KT_EINVAL, "kt_out_printf: NULL argument");
    if (f->failed_errno != 0)
        return sys_error(f->failed_errno, f->path, "cannot write");
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(f->buf + f->len, OUT_BUF - f->len, fmt, ap);
    va_end(ap);
    if (n < 0)
        return kt__error(KT_EINVAL, "%s: kt_out_printf: bad format", f->path);
    if ((size_t)n < OUT_BUF - f->len) {
        f->len += (size_t)n;
        return KT_OK;
    }
    /* too long for what is left: format it on its own (the truncated copy is overwritten) */
    char *text = malloc((size_t)n + 1);
    if (text == NULL)
        return kt__error(KT_ENOMEM, "%s: out of memory", f->path);
    va_start(ap, fmt);
    vsnprintf(text, (size_t)n + 1, fmt, ap);
    va_end(ap);
    kt_status s = kt_out_write(f, text, (size_t)n);
    free(text);
    return s;
}

kt_status kt_out_commit(kt_out_file *f)
{
    if (f == NULL)
        return kt__error(KT_EINVAL, "kt_out_commit: NULL argument");
    int exists;
    mode_t mode;
    kt_status s = flush(f);
    /* sync before rename: otherwise a crash can leave the new name over empty data */
    if (s == KT_OK && fsync(f->fd) != 0)
        s = sys_error(errno, f->path, "cannot sync the new data");
    /* again: something else may have taken the name since kt_out_open (checked before the
     * temporary gets a name, so a kill -9 has only link, close and rename to land between) */
    if (s == KT_OK)
        s = check_target(f->dirfd, f->base, f->path, &exists, &mode);
    if (s == KT_OK && !f->named)
        s = name_temp(f, f->fd);
    if (s == KT_OK) {
        int closed = close(f->fd);
        f->fd = -1;
        if (closed != 0)
            s = sys_error(errno, f->path, "cannot close the new file");
    }
    if (s == KT_OK) {
        if (renameat(f->dirfd, f->tmp, f->dirfd, f->base) != 0)
            s = sys_error(errno, f->path, "cannot replace it with the new file");
        else
            f->named = 0;
    }
    /* the rename itself is durable only once the directory is synced */
    if (s == KT_OK && fsync(f->dirfd) != 0 && errno != EINVAL)
        s = sys_error(errno, f->path, "written, but its directory cannot be synced");
    release(f);
    return s;
}

void kt_out_discard(kt_out_file *f)
{
    if (f != NULL)
        release(f);
}
