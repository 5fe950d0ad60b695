/* Input files opened without blocking (include/kt/io.h): a named FIFO given as an input would
 * otherwise wait in open() for a writer that may never come. */
#define _GNU_SOURCE
#include "kt/io.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "lib/core/error.h"
#include "lib/io/out_file.h"

/* Anonymous pipes live on this in-kernel filesystem; named FIFOs on the disk's. */
#define PIPEFS_MAGIC_NUMBER 0x50495045

/* An anonymous pipe has (or had) its writer already: reading it ends. */
static int is_anonymous_pipe(int fd, mode_t m)
{
    struct statfs fs;
    return S_ISFIFO(m) && fstatfs(fd, &fs) == 0 && fs.f_type == PIPEFS_MAGIC_NUMBER;
}

kt_status kt_in_open(const char *path, int *fd_out, int *is_regular_out)
{
    if (path == NULL || fd_out == NULL)
        return kt__error(KT_EINVAL, "kt_in_open: NULL argument");
    kt_status s = KT_OK;
    struct stat st;
    /* O_NONBLOCK: opening a FIFO for reading then returns at once, writer or not */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        s = kt__error(KT_EIO, "%s: cannot open: %s", path, strerror(errno));
        goto done;
    }
    if (fstat(fd, &st) != 0) {
        s = kt__error(KT_EIO, "%s: cannot stat: %s", path, strerror(errno));
        goto done;
    }
    if (S_ISDIR(st.st_mode)) {
        s = kt__error(KT_EIO, "%s: cannot read: %s", path, strerror(EISDIR));
        goto done;
    }
    if (!S_ISREG(st.st_mode) && !is_anonymous_pipe(fd, st.st_mode)) {
        s = kt__error(KT_EINVAL, "%s: is %s; an input must be a regular file (or a pipe)",
                      path, kt__file_kind(st.st_mode));
        goto done;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0)
        s = kt__error(KT_EIO, "%s: cannot make it blocking: %s", path, strerror(errno));
done:
    if (s != KT_OK) {
        if (fd >= 0)
            close(fd);
        return s;
    }
    *fd_out = fd;
    if (is_regular_out != NULL)
        *is_regular_out = S_ISREG(st.st_mode);
    return KT_OK;
}
