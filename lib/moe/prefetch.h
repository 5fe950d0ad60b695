/* Software fetches of a range of memory, a cache line at a time: the kernels and passes of
 * lib/moe use them where they read rows of a few hundred bytes kilobytes apart, which the
 * hardware prefetchers do not follow. Plain code, usable without a target attribute. */
#ifndef KT_MOE_PREFETCH_H
#define KT_MOE_PREFETCH_H

#include <stddef.h>
#include <stdint.h>

/* Where the lines go: into L1 to be read, into L1 to be written, or into L2 to be read. */
enum { KT__PF_READ = 0, KT__PF_WRITE = 1, KT__PF_READ_L2 = 2 };

/* Fetches every line of [p, p + bytes) (none when bytes is 0), as `how` says. */
static inline void kt__prefetch_range(const void *p, size_t bytes, int how)
{
    const uintptr_t first = (uintptr_t)p & ~(uintptr_t)63, end = (uintptr_t)p + bytes;
    for (uintptr_t a = first; a < end; a += 64) {
        if (how == KT__PF_WRITE)
            __builtin_prefetch((const void *)a, 1, 3);
        else if (how == KT__PF_READ_L2)
            __builtin_prefetch((const void *)a, 0, 2);
        else
            __builtin_prefetch((const void *)a, 0, 3);
    }
}

#endif
