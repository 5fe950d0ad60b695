/* libkt's environment variables, read strictly: a value that is set must parse whole and
 * lie in its range, so a typo (KT_NUM_THREADS=2x, KT_CPU=portabel) is an error naming the
 * variable instead of a silent default. */
#ifndef KT_CORE_ENV_H
#define KT_CORE_ENV_H

#include <stdint.h>

#include "kt/status.h"

/* Unset or empty: *found = 0 and *out untouched. Set: a whole decimal number in [lo, hi],
 * else KT_EINVAL "NAME='value' is not <what> (lo to hi)". */
kt_status kt__env_int(const char *name, long long lo, long long hi, const char *what,
                      long long *out, int *found);
/* Unset or empty: *index_out = -1. Set: one of names[0..n), else KT_EINVAL listing them. */
kt_status kt__env_choice(const char *name, const char *const *names, int n, int *index_out);
/* A byte count with an optional K, M, G or T suffix (powers of 1024), for KT_MEMORY_LIMIT. */
kt_status kt__env_bytes(const char *name, uint64_t *out, int *found);

/* The KT_CPU choices, in this order (cpu.c reads them by index). */
enum { KT__CPU_PORTABLE, KT__CPU_NOAMX, KT__CPU_DPBF16, KT__CPU_WIDEN, KT__CPU_BLAS,
       KT__CPU_AVX2, KT__CPU_CHOICES };
extern const char *const kt__cpu_choices[KT__CPU_CHOICES];
/* The KT_COMM_TRANSPORT choices, in kt_comm_transport's order (default, shm, tcp). */
extern const char *const kt__transport_choices[3];

#endif
