/* The runtime core that every other part stands on: arenas, the thread pool, CPU features
 * and NUMA placement.
 */
#ifndef KT_RUNTIME_H
#define KT_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Arena: an aligned bump allocator ------------------------------------------------- */

typedef struct kt_arena {
    unsigned char *base;
    size_t size;     /* usable bytes */
    size_t used;     /* bytes handed out, including alignment padding */
    size_t high_water;
    int numa_node;   /* node the memory is bound to, or -1 */
    int owned;       /* 1 when kt_arena_destroy must free base */
} kt_arena;

/* Allocates `size` bytes (64-byte aligned). numa_node >= 0 binds the memory to that node
 * (needs libnuma; node 0 is accepted without it); -1 lets the OS place it. */
kt_status kt_arena_create(kt_arena *arena, size_t size, int numa_node);
/* Uses caller memory; nothing is freed by kt_arena_destroy. */
kt_status kt_arena_init_buffer(kt_arena *arena, void *buffer, size_t size);
/* Frees owned memory and zeroes the struct; safe on a zeroed or destroyed arena. */
void kt_arena_destroy(kt_arena *arena);

/* `align` is a power of two (0 means 64). Exhaustion returns KT_ENOMEM with the requested
 * and available byte counts in the message, and leaves the arena unchanged. */
kt_status kt_arena_alloc(kt_arena *arena, size_t bytes, size_t align, void **ptr_out);
/* mark/reset: everything allocated after the mark is released by the reset. */
size_t kt_arena_mark(const kt_arena *arena);
kt_status kt_arena_reset(kt_arena *arena, size_t mark);
size_t kt_arena_available(const kt_arena *arena);

/* ---- Thread pool ------------------------------------------------------------------------ */

typedef struct kt_threadpool kt_threadpool;

#define KT_MAX_THREADS 1024 /* threads in one pool */

/* n_threads <= 0: KT_NUM_THREADS from the environment (1 to KT_MAX_THREADS; any other value
 * is an error), else the number of online CPUs.
 * The caller's thread is thread 0, so n_threads - 1 workers are started. */
kt_status kt_threadpool_create(int n_threads, kt_threadpool **pool_out);
/* Lifetime: not reference-counted; whoever is given a pool (a session's options, a MoE layer)
 * borrows it, so destroy it after them. On failure the create functions leave *pool_out NULL. */
void kt_threadpool_destroy(kt_threadpool *pool);
int kt_threadpool_size(const kt_threadpool *pool); /* 1 for a NULL pool */

/* Runs fn over [0, n). The range is cut into at most size(pool) contiguous parts of at least
 * `grain` items, part t going to thread t: a fixed, static partition, so a fixed thread count
 * gives bitwise identical results. A NULL pool runs everything on the caller's thread.
 * Calls from several threads at once are serialised (one submission lock per pool), so two
 * jobs never interleave. Calls do not nest: fn must not call kt_parallel_for on the same pool
 * (it would wait for itself). */
typedef void (*kt_range_fn)(void *ctx, int64_t begin, int64_t end, int thread);
void kt_parallel_for(kt_threadpool *pool, int64_t n, int64_t grain, kt_range_fn fn,
                     void *ctx);

/* ---- CPU features ------------------------------------------------------------------------ */

typedef struct kt_cpu_features {
    int avx2;         /* with FMA */
    int f16c;
    int avx512f;      /* with the OS saving zmm state */
    int avx512bw;
    int avx512_bf16;
    int amx_tile;     /* the CPU has AMX ... */
    int amx_bf16;
    int amx_usable;   /* ... and the kernel granted this process the tile state */
    int bf16_on_fma;  /* bf16 GEMMs run faster widened to f32 on the FMA units than on
                       * vdpbf16ps (Intel cores issue it at half the FMA rate; or no
                       * AVX-512 BF16 at all): avx512f + avx512bw and one of those */
} kt_cpu_features;

/* Detected once (thread-safe) and cached. The AMX permission request
 * (arch_prctl ARCH_REQ_XCOMP_PERM) is made on the first call when the CPU has AMX. */
const kt_cpu_features *kt_cpu_get_features(void);
/* "avx2 f16c avx512f ..." */
const char *kt_cpu_describe(void);

/* ---- NUMA ---------------------------------------------------------------------------------- */

/* 1 when libkt was built with libnuma and the system reports NUMA support. */
int kt_numa_available(void);
/* Number of configured nodes (1 without libnuma). KT_NUMA_FAKE_NODES=N (tests) reports N
 * nodes, node j standing for the real node j mod the real count, each with every CPU. */
int kt_numa_node_count(void);

/* A pool whose threads are spread over the NUMA nodes in contiguous blocks (thread t on node
 * t * nodes / n_threads) and pinned to their node's CPUs; the caller stays thread 0 and is
 * not pinned (pin it to node 0 for full locality). One node, or a build without libnuma:
 * an ordinary pool whose threads all report node 0. */
kt_status kt_threadpool_create_numa(int n_threads, kt_threadpool **pool_out);
/* The node thread t of the pool was placed on, or -1 for a pool not made by
 * kt_threadpool_create_numa (or a NULL pool, or t out of range). */
int kt_threadpool_thread_node(const kt_threadpool *pool, int thread);

/* ---- CUDA ---------------------------------------------------------------------------------- */

/* Number of usable CUDA devices: 0 in a build without CUDA or on a machine without a GPU
 * (never an error). */
int kt_cuda_device_count(void);

/* ---- Environment and memory ---------------------------------------------------------- */

/* Checks every environment variable libkt reads (KT_NUM_THREADS, KT_CPU, KT_NUMA_FAKE_NODES,
 * KT_COMM_TIMEOUT_MS, KT_COMM_TRANSPORT, KT_MEMORY_LIMIT): one that is set must hold a valid
 * value, else KT_EINVAL naming it. Functions that read a variable refuse a bad value too
 * where they can fail; kt_cpu_features cannot, and treats a bad KT_CPU as unset, so tools
 * call this first. */
kt_status kt_check_environment(void);

/* The bytes this process can still commit: the kernel's MemAvailable, lowered to what the
 * cgroup's memory limit leaves, and to KT_MEMORY_LIMIT when set (a byte count with an
 * optional K/M/G/T suffix). Sessions and MoE layers check what they are about to allocate
 * against it before committing anything. */
kt_status kt_memory_available(uint64_t *bytes_out);
/* A byte count for people: "33.6 GB", "512 KB", "17 bytes" (decimal units); returns buf. */
const char *kt_format_bytes(uint64_t bytes, char *buf, size_t size);

#ifdef __cplusplus
}
#endif
#endif
