/* kt__read_upto: see read_upto.h. */
#include "lib/core/read_upto.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lib/core/error.h"

kt_status kt__read_upto(int fd, const char *path, unsigned char **buf, size_t *len, size_t *cap,
                        size_t want)
{
    while (*len < want) {
        if (*len == *cap) {
            size_t grown = *cap ? *cap * 2 : 65536;
            grown = grown > want ? want : grown;
            unsigned char *b = realloc(*buf, grown);
            if (b == NULL)
                return kt__error(KT_ENOMEM, "%s: out of memory reading it (%zu bytes)", path,
                                 grown);
            *buf = b;
            *cap = grown;
        }
        ssize_t got = read(fd, *buf + *len, *cap - *len);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            return kt__error(KT_EIO, "%s: cannot read: %s", path, strerror(errno));
        if (got == 0)
            break;
        *len += (size_t)got;
    }
    return KT_OK;
}
