/* The arena: one aligned block handed out by bumping an offset. Sessions size their arenas
 * at creation from the memory plan, so running a program never allocates. */
#include <stdint.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/core/numa_internal.h"
#include "kt/runtime.h"

#define KT__ARENA_ALIGN 64

kt_status kt_arena_create(kt_arena *arena, size_t size, int numa_node)
{
    if (arena == NULL)
        return kt__error(KT_EINVAL, "kt_arena_create: arena is NULL");
    void *p = NULL;
    KT__TRY(kt__numa_alloc(size, numa_node, &p));
    memset(arena, 0, sizeof *arena);
    arena->base = p;
    arena->size = size;
    arena->numa_node = numa_node;
    arena->owned = 1;
    return KT_OK;
}

kt_status kt_arena_init_buffer(kt_arena *arena, void *buffer, size_t size)
{
    if (arena == NULL || (buffer == NULL && size > 0))
        return kt__error(KT_EINVAL, "kt_arena_init_buffer: NULL arena or buffer");
    memset(arena, 0, sizeof *arena);
    arena->base = buffer;
    arena->size = size;
    arena->numa_node = -1;
    return KT_OK;
}

void kt_arena_destroy(kt_arena *arena)
{
    if (arena == NULL)
        return;
    if (arena->owned)
        kt__numa_free(arena->base, arena->size, arena->numa_node);
    memset(arena, 0, sizeof *arena);
}

kt_status kt_arena_alloc(kt_arena *arena, size_t bytes, size_t align, void **ptr_out)
{
    if (arena == NULL || ptr_out == NULL)
        return kt__error(KT_EINVAL, "kt_arena_alloc: NULL argument");
    if (align == 0)
        align = KT__ARENA_ALIGN;
    if ((align & (align - 1)) != 0)
        return kt__error(KT_EINVAL, "kt_arena_alloc: alignment %zu is not a power of two",
                         align);
    uintptr_t base = (uintptr_t)arena->base;
    uintptr_t cur = base + arena->used;
    size_t pad = (size_t)((align - (cur & (align - 1))) & (align - 1));
    size_t available = arena->size - arena->used;
    if (pad > available || bytes > available - pad)
        return kt__error(KT_ENOMEM,
                         "arena exhausted: requested %zu bytes (aligned to %zu), %zu available "
                         "of %zu",
                         bytes, align, available > pad ? available - pad : 0, arena->size);
    arena->used += pad + bytes;
    if (arena->used > arena->high_water)
        arena->high_water = arena->used;
    *ptr_out = (void *)(cur + pad);
    return KT_OK;
}

size_t kt_arena_mark(const kt_arena *arena) { return arena->used; }

kt_status kt_arena_reset(kt_arena *arena, size_t mark)
{
    if (mark > arena->used)
        return kt__error(KT_EINVAL, "kt_arena_reset: mark %zu is beyond the %zu bytes in use",
                         mark, arena->used);
    arena->used = mark;
    return KT_OK;
}

size_t kt_arena_available(const kt_arena *arena) { return arena->size - arena->used; }
