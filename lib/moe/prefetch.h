/* Software fetches of a range of memory, a cache line at a time: the kernels and passes of
 * lib/moe use them where they read rows of a few hundred bytes that lie kilobytes apart,
 * which the hardware prefetchers do not follow. Plain code, usable without a target attribute. */
#ifndef KT_MOE_PREFETCH_H
#define KT_MOE_PREFETCH_H

#include <stddef.h>
#include <stdint.h>

/* Where the lines go: into L1 to be read, into L1 to be written, or into L2 to be read. */
enum { KT__PF_READ = 0, KT__PF_WRITE = 1, KT__PF_READ_L2 = 2 };

/* The line at a. On x86-64 an asm statement, which the compiler must keep: the per-token
 * sums' fetch of the next slot's row, a loop of __builtin_prefetch over a signed counter,
 * had compiled to no instruction at all in combine_part and gx_combine_part (gcc 12, -O3;
 * the same loop alone in a file kept its prefetch, and over an unsigned counter it was kept
 * there too). With the fetches in, dsv2lite qlen 1024 (alternating builds, 3-4 runs each):
 * combine 2.65-2.68 -> 1.70-1.85 ms, input_combine 2.82-2.85 -> 1.73-1.99. Writes are
 * fetched as reads (prefetchw needs PRFCHW; __builtin_prefetch emitted prefetcht0 too). */
static inline void kt__prefetch_line(const void *a, int how)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (how == KT__PF_READ_L2)
        __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)a));
    else
        __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)a));
#else
    if (how == KT__PF_WRITE)
        __builtin_prefetch(a, 1, 3);
    else if (how == KT__PF_READ_L2)
        __builtin_prefetch(a, 0, 2);
    else
        __builtin_prefetch(a, 0, 3);
#endif
}

/* Fetches every line of [p, p + bytes) (none when bytes is 0), as `how` says. */
static inline void kt__prefetch_range(const void *p, size_t bytes, int how)
{
    const uintptr_t first = (uintptr_t)p & ~(uintptr_t)63, end = (uintptr_t)p + bytes;
    for (uintptr_t a = first; a < end; a += 64)
        kt__prefetch_line((const void *)a, how);
}

#endif
