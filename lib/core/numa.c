/* NUMA placement. With libnuma, memory is bound to a node with numa_alloc_onnode; without it
 * there is one node (0) and memory comes from the ordinary allocator. */
#include <stdint.h>
#include <stdlib.h>

#include "core/error.h"
#include "core/numa_internal.h"
#include "kt/runtime.h"

#ifdef KT_HAVE_NUMA
#include <numa.h>
#endif

#define KT__PAGE_ALIGN 4096

int kt_numa_available(void)
{
#ifdef KT_HAVE_NUMA
    return numa_available() >= 0;
#else
    return 0;
#endif
}

int kt_numa_node_count(void)
{
#ifdef KT_HAVE_NUMA
    if (numa_available() >= 0)
        return numa_num_configured_nodes();
#endif
    return 1;
}

static kt_status plain_alloc(size_t size, void **ptr_out)
{
    void *p = NULL;
    if (size > SIZE_MAX - KT__PAGE_ALIGN) /* rounding up would wrap to a tiny block */
        return kt__error(KT_ENOMEM, "arena: cannot allocate %zu bytes", size);
    size_t rounded = (size + KT__PAGE_ALIGN - 1) / KT__PAGE_ALIGN * KT__PAGE_ALIGN;
    if (posix_memalign(&p, KT__PAGE_ALIGN, rounded ? rounded : KT__PAGE_ALIGN) != 0)
        return kt__error(KT_ENOMEM, "arena: cannot allocate %zu bytes", size);
    *ptr_out = p;
    return KT_OK;
}

kt_status kt__numa_alloc(size_t size, int node, void **ptr_out)
{
    if (node < -1)
        return kt__error(KT_EINVAL, "arena: NUMA node %d is invalid (use -1 for any)", node);
    if (node == -1)
        return plain_alloc(size, ptr_out);
    int nodes = kt_numa_node_count();
    if (node >= nodes)
        return kt__error(KT_EINVAL, "arena: NUMA node %d does not exist (%d node%s)", node,
                         nodes, nodes == 1 ? "" : "s");
#ifdef KT_HAVE_NUMA
    if (kt_numa_available()) {
        void *p = numa_alloc_onnode(size ? size : 1, node);
        if (p == NULL)
            return kt__error(KT_ENOMEM, "arena: cannot allocate %zu bytes on NUMA node %d",
                             size, node);
        *ptr_out = p;
        return KT_OK;
    }
#endif
    return plain_alloc(size, ptr_out); /* node 0 of a single-node machine */
}

void kt__numa_free(void *ptr, size_t size, int node)
{
    if (ptr == NULL)
        return;
#ifdef KT_HAVE_NUMA
    if (node >= 0 && kt_numa_available()) {
        numa_free(ptr, size ? size : 1);
        return;
    }
#else
    (void)size;
#endif
    (void)node;
    free(ptr);
}
