/* Reading a file of unknown size (a pipe, a device) by what its own header declares: the
 * loaders (safetensors, programs) read so far and no further, so an endless input cannot
 * grow their memory without bound. */
#ifndef KT_CORE_READ_UPTO_H
#define KT_CORE_READ_UPTO_H

#include <stddef.h>

#include "kt/status.h"

/* Reads from fd into *buf (grown as needed; its capacity in *cap) until it holds `want` bytes
 * or the input ends; *len counts what it holds. Errors (KT_EIO, KT_ENOMEM) name path. */
kt_status kt__read_upto(int fd, const char *path, unsigned char **buf, size_t *len, size_t *cap,
                        size_t want);

#endif
