/* Strict parsing of libkt's environment variables, and kt_check_environment, which checks
 * every one of them up front (the tools call it before any work). */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/env.h"
#include "lib/core/error.h"
#include "kt/runtime.h"

const char *const kt__cpu_choices[KT__CPU_CHOICES] = {"portable", "noamx", "dpbf16", "widen",
                                                      "blas", "avx2"};
const char *const kt__transport_choices[3] = {"default", "shm", "tcp"};

/* Shown in messages: at most 40 bytes, anything but printable ASCII as '?' (an environment
 * value may be any bytes). */
static const char *shown(const char *v, char *buf, size_t size)
{
    size_t n = 0;
    for (; v[n] != '\0' && n + 4 < size && n < 40; n++)
        buf[n] = v[n] >= 0x20 && v[n] < 0x7f ? v[n] : '?';
    snprintf(buf + n, size - n, "%s", v[n] != '\0' ? "..." : "");
    return buf;
}

kt_status kt__env_int(const char *name, long long lo, long long hi, const char *what,
                      long long *out, int *found)
{
    const char *v = getenv(name);
    *found = 0;
    if (v == NULL || v[0] == '\0')
        return KT_OK;
    char *end = NULL, buf[48];
    errno = 0;
    /* strtoll would skip leading blanks and take a '+': the whole value must be the number */
    const int starts = (v[0] >= '0' && v[0] <= '9') || (v[0] == '-' && v[1] >= '0' && v[1] <= '9');
    long long x = starts ? strtoll(v, &end, 10) : 0;
    if (!starts || errno != 0 || *end != '\0' || x < lo || x > hi)
        return kt__error(KT_EINVAL, "%s='%s' is not %s (%lld to %lld)", name,
                         shown(v, buf, sizeof buf), what, lo, hi);
    *out = x;
    *found = 1;
    return KT_OK;
}

kt_status kt__env_choice(const char *name, const char *const *names, int n, int *index_out)
{
    const char *v = getenv(name);
    *index_out = -1;
    if (v == NULL || v[0] == '\0')
        return KT_OK;
    for (int i = 0; i < n; i++)
        if (strcmp(v, names[i]) == 0) {
            *index_out = i;
            return KT_OK;
        }
    char list[256] = "", buf[48];
    for (int i = 0, len = 0; i < n && len < (int)sizeof list; i++)
        len += snprintf(list + len, sizeof list - (size_t)len, "%s%s", i ? ", " : "", names[i]);
    return kt__error(KT_EINVAL, "%s='%s' is not one of: %s", name, shown(v, buf, sizeof buf),
                     list);
}

kt_status kt__env_bytes(const char *name, uint64_t *out, int *found)
{
    const char *v = getenv(name);
    *found = 0;
    if (v == NULL || v[0] == '\0')
        return KT_OK;
    char *end = NULL, buf[48];
    errno = 0;
    unsigned long long x = v[0] >= '0' && v[0] <= '9' ? strtoull(v, &end, 10) : 0;
    int shift = 0;
    if (end != NULL && end != v && end[0] != '\0' && end[1] == '\0') {
        const char *units = "KMGT", *u = strchr(units, end[0] & ~0x20);
        shift = u != NULL ? 10 * (int)(u - units + 1) : -1;
        end += shift > 0;
    }
    if (end == NULL || end == v || errno != 0 || *end != '\0' || shift < 0 || x == 0 ||
        (shift > 0 && x > (ULLONG_MAX >> shift)))
        return kt__error(KT_EINVAL, "%s='%s' is not a byte count (a positive number, with an "
                         "optional K, M, G or T suffix)", name, shown(v, buf, sizeof buf));
    *out = (uint64_t)x << shift;
    *found = 1;
    return KT_OK;
}

kt_status kt_check_environment(void)
{
    long long x;
    int found, choice;
    uint64_t bytes;
    KT__TRY(kt__env_int("KT_NUM_THREADS", 1, KT_MAX_THREADS, "a thread count", &x, &found));
    KT__TRY(kt__env_choice("KT_CPU", kt__cpu_choices, KT__CPU_CHOICES, &choice));
    KT__TRY(kt__env_int("KT_NUMA_FAKE_NODES", 1, 64, "a node count", &x, &found));
    KT__TRY(kt__env_int("KT_COMM_TIMEOUT_MS", 1, INT_MAX, "a time in milliseconds", &x, &found));
    KT__TRY(kt__env_bytes("KT_MEMORY_LIMIT", &bytes, &found));
    return kt__env_choice("KT_COMM_TRANSPORT", kt__transport_choices, 3, &choice);
}
