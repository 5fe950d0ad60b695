/* Software fetches of a range of memory, a cache line at a time: the kernels and passes of
 * lib/kernels use them where they read rows of a few hundred bytes that lie kilobytes apart,
 * which the hardware prefetchers do not follow. Plain code, usable without a target attribute. */
#ifndef KT_KERNELS_PREFETCH_H
#define KT_KERNELS_PREFETCH_H

#include <stddef.h>
#include <stdint.h>

/* Where the lines go: into L1 to be read, into L1 to be written, or into L2 to be read. */
enum { KT__PF_READ = 0, KT__PF_WRITE = 1, KT__PF_READ_L2 = 2 };

/* The line at a. On x86-64 an asm statement, which the compiler must keep: the per-token
 * sums' fetch of the next slot's row, a loop of __builtin_prefetch over a signed counter,
 * had compiled to no instruction at all in combine_part and gx_combine_part (gcc 12, -O3;
 * the same loop alone in a file kept its prefetch, and over an unsigned counter it was kept
 * there too), and those phases ran far slower without the fetches. Writes are
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

/* Lines fetched in address order, one per step: rows of row_bytes (their start need not be on
 * a line), ld_bytes apart. The kernels walk a block of the weights in pieces of a few hundred
 * bytes of rows kilobytes apart, which the hardware prefetchers do not follow; a cursor fetches
 * the next block's lines into L2 spread over this block's steps (a burst of hundreds of
 * fetches waits on the miss buffers). */
typedef struct kt__line_cursor {
    const char *base;
    int64_t ld_bytes, rows, row_bytes, row;
    const char *line, *end; /* the next line of this row, and the row's end */
} kt__line_cursor;

static inline void kt__cursor_row(kt__line_cursor *f, int64_t row)
{
    const char *start = f->base + row * f->ld_bytes;
    f->row = row;
    f->line = start - ((uintptr_t)start & 63);
    f->end = start + f->row_bytes;
}

/* A cursor over `rows` rows from base (none when base is NULL). */
static inline void kt__cursor_init(kt__line_cursor *f, const void *base, int64_t ld_bytes,
                                   int64_t rows, int64_t row_bytes)
{
    f->base = base, f->ld_bytes = ld_bytes, f->rows = base != NULL && row_bytes > 0 ? rows : 0;
    f->row_bytes = row_bytes, f->row = 0, f->line = f->end = NULL;
    if (f->rows > 0)
        kt__cursor_row(f, 0);
}

/* Fetches the cursor's next line into L2 (nothing once past its last row). */
static inline void kt__cursor_step(kt__line_cursor *f)
{
    if (f->row >= f->rows)
        return;
    /* the builtin, not kt__prefetch_line's asm statement: inside the FMA tiles' loop the asm
     * made GCC 12 keep the 24 accumulators in memory (NT at 48 rows 1.4x slower). The builtin
     * can be dropped (above); objdump showed prefetcht1 in each of the tiles' and fma_unpacked.c's
     * loops (gcc 12, -O3), and a dropped fetch shows in kt-bench gemm as slower, not wrong. */
    __builtin_prefetch(f->line, 0, 2);
    f->line += 64;
    if (f->line >= f->end)
        kt__cursor_row(f, f->row + 1);
}

/* Steps per line that spread the cursor's lines over `steps` steps (at least 1; a bound on
 * the lines: a row may touch one more line than its bytes fill). */
static inline int64_t kt__cursor_period(const kt__line_cursor *f, int64_t steps)
{
    const int64_t lines = f->rows * ((f->row_bytes + 63) / 64 + 1);
    return lines > 0 && steps > lines ? steps / lines : 1;
}

#endif
