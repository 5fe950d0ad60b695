/* Node-bound page allocation (libnuma when built with it). */
#ifndef KT_CORE_NUMA_INTERNAL_H
#define KT_CORE_NUMA_INTERNAL_H

#include <stddef.h>

#include "kt/status.h"

/* Allocates `size` bytes (page aligned) on `node`, or anywhere for node -1. */
kt_status kt__numa_alloc(size_t size, int node, void **ptr_out);
/* size and node: exactly those given to kt__numa_alloc (large blocks are mappings). */
void kt__numa_free(void *ptr, size_t size, int node);
/* Binds the whole pages inside [ptr, ptr + size) to `node` (pages already touched are
 * moved); a no-op without libnuma (one node). */
kt_status kt__numa_bind_range(void *ptr, size_t size, int node);

#if defined(__linux__) && defined(_GNU_SOURCE)
#include <sched.h>
/* The CPUs of `node` (every CPU for a fake node, or without libnuma). Needs _GNU_SOURCE
 * defined before the first system header. */
kt_status kt__numa_node_cpus(int node, cpu_set_t *set);
#endif

#endif
