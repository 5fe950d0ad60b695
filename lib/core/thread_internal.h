/* Starting the library's own threads (pool workers, the MoE layer's driver). */
#ifndef KT_CORE_THREAD_INTERNAL_H
#define KT_CORE_THREAD_INTERNAL_H

#include <pthread.h>

/* The stack of every thread the library starts: the kernels keep their tiles' buffers on the
 * stack (up to 176 KiB in the MoE TN kernel), more than some C libraries give a thread by
 * default (musl: 128 KiB). A caller's own thread that runs kernels (thread 0 of a pool, the
 * thread calling kt_moe_backward) needs the same margin; glibc's default (8 MiB) has it. */
#define KT__THREAD_STACK_BYTES ((size_t)4 << 20)

/* pthread_create with that stack size; returns pthread_create's result */
int kt__thread_start(pthread_t *thread, void *(*fn)(void *), void *arg);

#endif
