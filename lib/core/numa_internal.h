/* Node-bound page allocation (libnuma when built with it). */
#ifndef KT_CORE_NUMA_INTERNAL_H
#define KT_CORE_NUMA_INTERNAL_H

#include <stddef.h>

#include "kt/status.h"

/* Allocates `size` bytes (page aligned) on `node`, or anywhere for node -1. */
kt_status kt__numa_alloc(size_t size, int node, void **ptr_out);
void kt__numa_free(void *ptr, size_t size, int node);

#endif
