/* NUMA placement. With libnuma, memory is bound to a node with numa_alloc_onnode; without it
 * there is one node (0) and memory comes from the ordinary allocator. */
#define _GNU_SOURCE /* cpu_set_t */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "lib/core/env.h"
#include "lib/core/error.h"
#include "lib/core/numa_internal.h"
#include "kt/runtime.h"

#ifdef KT_HAVE_NUMA
#include <numa.h>
#include <numaif.h>
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

static int real_node_count(void)
{
#ifdef KT_HAVE_NUMA
    if (numa_available() >= 0)
        return numa_num_configured_nodes();
#endif
    return 1;
}

/* KT_NUMA_FAKE_NODES=N: a test hook that lets the NUMA code paths (expert split, per-node
 * threads) run on a machine with one node. 0 when unset or invalid. */
static int fake_node_count(void)
{
    long long v = 0;
    int found;
    kt_status st = kt__env_int("KT_NUMA_FAKE_NODES", 1, 64, "a node count", &v, &found);
    return st == KT_OK && found ? (int)v : 0; /* kt_check_environment reports a bad one */
}

int kt_numa_node_count(void)
{
    int fake = fake_node_count();
    return fake ? fake : real_node_count();
}

#ifdef KT_HAVE_NUMA
/* The real node a (possibly fake, see kt_numa_node_count) node stands for. */
static int real_node(int node) { return node < 0 ? node : node % real_node_count(); }
#endif

/* KT_OK when node names one of kt_numa_node_count()'s nodes; what names the caller */
static kt_status check_node(const char *what, int node)
{
    const int nodes = kt_numa_node_count();
    if (node < 0 || node >= nodes)
        return kt__error(KT_EINVAL, "%sNUMA node %d does not exist (%d node%s)", what, node,
                         nodes, nodes == 1 ? "" : "s");
    return KT_OK;
}

kt_status kt__numa_bind_range(void *ptr, size_t size, int node)
{
    KT__TRY(check_node("", node));
    const uintptr_t page = KT__PAGE_ALIGN;
    uintptr_t b = ((uintptr_t)ptr + page - 1) / page * page;
    uintptr_t e = ((uintptr_t)ptr + size) / page * page;
    if (e <= b)
        return KT_OK;
#ifdef KT_HAVE_NUMA
    if (kt_numa_available()) {
        /* mbind itself rather than numa_tonode_memory: its failure is returned (libnuma
         * would print it), and MPOL_MF_MOVE moves pages someone already touched */
        const int real = real_node(node);
        unsigned long mask[16] = {0};
        if (real >= (int)(sizeof mask * 8))
            return kt__error(KT_EINVAL, "NUMA node %d is beyond the %zu nodes a binding can name",
                             real, sizeof mask * 8);
        mask[real / (8 * sizeof mask[0])] |= 1ul << (real % (8 * sizeof mask[0]));
        if (mbind((void *)b, (unsigned long)(e - b), MPOL_BIND, mask, sizeof mask * 8 + 1,
                  MPOL_MF_MOVE) != 0)
            return kt__error(KT_EINVAL, "cannot bind %zu bytes to NUMA node %d: %s",
                             (size_t)(e - b), real, strerror(errno));
        return KT_OK;
    }
#endif
    return KT_OK; /* one node: nothing to bind */
}

#ifdef __linux__
kt_status kt__numa_node_cpus(int node, cpu_set_t *set)
{
    CPU_ZERO(set);
#ifdef KT_HAVE_NUMA
    if (kt_numa_available() && !fake_node_count()) {
        struct bitmask *bm = numa_allocate_cpumask();
        if (bm == NULL)
            return kt__error(KT_ENOMEM, "NUMA: out of memory for a CPU mask");
        int rc = numa_node_to_cpus(node, bm);
        for (unsigned i = 0; rc == 0 && i < bm->size && i < CPU_SETSIZE; i++)
            if (numa_bitmask_isbitset(bm, i))
                CPU_SET(i, set);
        numa_free_cpumask(bm);
        if (rc != 0 || CPU_COUNT(set) == 0)
            return kt__error(KT_EINVAL, "NUMA node %d has no CPUs", node);
        return KT_OK;
    }
#endif
    (void)node;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    for (long i = 0; i < cpus && i < CPU_SETSIZE; i++)
        CPU_SET((int)i, set);
    return KT_OK;
}
#endif

/* Arenas this large ask for transparent huge pages: the MoE kernels walk weight matrices
 * down their columns, one 4 KiB-apart row after another, and with 4 KiB pages every row is a
 * TLB miss. */
#define KT__HUGE_MIN (8u << 20)
#define KT__HUGE_ALIGN (2u << 20)

static void advise_huge(void *p, size_t size)
{
#ifdef MADV_HUGEPAGE
    if (size >= KT__HUGE_MIN)
        (void)madvise(p, size, MADV_HUGEPAGE); /* a hint: refused or unsupported is fine */
#else
    (void)p, (void)size;
#endif
}

/* Large arenas come straight from mmap, aligned to 2 MiB: fresh pages that no one has
 * touched, so that a NUMA binding of their ranges (kt__numa_bind_range) decides where they
 * land (heap pages from malloc may already be placed), and whole huge pages. */
static size_t mapped_size(size_t size)
{
    return (size + KT__HUGE_ALIGN - 1) / KT__HUGE_ALIGN * KT__HUGE_ALIGN;
}

static kt_status map_alloc(size_t size, void **ptr_out)
{
    const size_t rounded = mapped_size(size), span = rounded + KT__HUGE_ALIGN;
    unsigned char *p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return kt__error(KT_ENOMEM, "arena: cannot map %zu bytes", size);
    /* keep the 2 MiB-aligned part, give back the ends */
    unsigned char *a = (unsigned char *)(((uintptr_t)p + KT__HUGE_ALIGN - 1) &
                                         ~(uintptr_t)(KT__HUGE_ALIGN - 1));
    if (a > p)
        munmap(p, (size_t)(a - p));
    if (p + span > a + rounded)
        munmap(a + rounded, (size_t)(p + span - (a + rounded)));
    advise_huge(a, rounded);
    *ptr_out = a;
    return KT_OK;
}

static kt_status plain_alloc(size_t size, void **ptr_out)
{
    void *p = NULL;
    if (size > SIZE_MAX / 2) /* rounding up would wrap to a tiny block */
        return kt__error(KT_ENOMEM, "arena: cannot allocate %zu bytes", size);
    if (size >= KT__HUGE_MIN)
        return map_alloc(size, ptr_out);
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
    KT__TRY(check_node("arena: ", node));
#ifdef KT_HAVE_NUMA
    if (kt_numa_available()) {
        void *p = numa_alloc_onnode(size ? size : 1, real_node(node));
        if (p == NULL)
            return kt__error(KT_ENOMEM, "arena: cannot allocate %zu bytes on NUMA node %d",
                             size, node);
        advise_huge(p, size);
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
#endif
    (void)node;
    if (size >= KT__HUGE_MIN)
        munmap(ptr, mapped_size(size));
    else
        free(ptr);
}
