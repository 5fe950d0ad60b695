/* What this process can still commit, from the kernel (MemAvailable), its cgroup's memory
 * limit and KT_MEMORY_LIMIT; and the admission check sessions and MoE layers make with it. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/env.h"
#include "lib/core/error.h"
#include "lib/core/memory.h"
#include "kt/runtime.h"

/* The first number after `key` in a small text file (/proc/meminfo, a cgroup file); 0 when
 * the file or key is missing, or the value is "max". */
static int read_value(const char *path, const char *key, uint64_t *out)
{
    char buf[8192];
    FILE *f = fopen(path, "re");
    if (f == NULL)
        return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *at = key != NULL ? strstr(buf, key) : buf;
    if (at == NULL)
        return 0;
    at += key != NULL ? strlen(key) : 0;
    char *end = NULL;
    unsigned long long v = strtoull(at, &end, 10);
    if (end == at)
        return 0;
    *out = (uint64_t)v;
    return 1;
}

/* The cgroup v2 limit left: memory.max - memory.current of this process's cgroup. */
static int cgroup_left(uint64_t *out)
{
    char line[4096], dir[4200];
    FILE *f = fopen("/proc/self/cgroup", "re");
    if (f == NULL)
        return 0;
    int found = 0;
    while (!found && fgets(line, sizeof line, f) != NULL)
        if (strncmp(line, "0::", 3) == 0) {
            line[strcspn(line, "\n")] = '\0';
            snprintf(dir, sizeof dir, "/sys/fs/cgroup%s", line + 3);
            found = 1;
        }
    fclose(f);
    char path[4300];
    uint64_t max = 0, current = 0;
    if (!found)
        return 0;
    snprintf(path, sizeof path, "%s/memory.max", dir);
    if (!read_value(path, NULL, &max))
        return 0; /* "max": no limit */
    snprintf(path, sizeof path, "%s/memory.current", dir);
    if (!read_value(path, NULL, &current))
        return 0;
    *out = current < max ? max - current : 0;
    return 1;
}

/* available, and in `source` which limit set it */
static kt_status available(uint64_t *bytes_out, const char **source)
{
    uint64_t avail = UINT64_MAX, v, limit;
    int found;
    *source = "no limit known";
    if (read_value("/proc/meminfo", "MemAvailable:", &v) && v <= UINT64_MAX / 1024) {
        avail = v * 1024;
        *source = "the kernel's MemAvailable";
    }
    if (cgroup_left(&v) && v < avail) {
        avail = v;
        *source = "what the cgroup's memory.max leaves";
    }
    KT__TRY(kt__env_bytes("KT_MEMORY_LIMIT", &limit, &found));
    if (found && limit < avail) {
        avail = limit;
        *source = "KT_MEMORY_LIMIT";
    }
    *bytes_out = avail;
    return KT_OK;
}

kt_status kt_memory_available(uint64_t *bytes_out)
{
    if (bytes_out == NULL)
        return kt__error(KT_EINVAL, "kt_memory_available: bytes_out is NULL");
    const char *source;
    return available(bytes_out, &source);
}

const char *kt_format_bytes(uint64_t bytes, char *buf, size_t size)
{
    static const char *const units[] = {"KB", "MB", "GB", "TB", "PB"};
    if (bytes < 1000) {
        snprintf(buf, size, "%" PRIu64 " bytes", bytes);
        return buf;
    }
    double v = (double)bytes / 1000.0;
    int u = 0;
    for (; v >= 1000.0 && u < 4; u++)
        v /= 1000.0;
    snprintf(buf, size, "%.*f %s", v < 10.0 ? 2 : v < 100.0 ? 1 : 0, v, units[u]);
    return buf;
}

kt_status kt__memory_admit(uint64_t bytes, const char *what)
{
    uint64_t avail;
    const char *source;
    KT__TRY(available(&avail, &source));
    if (bytes <= avail)
        return KT_OK;
    char need[32], have[32];
    return kt__error(KT_ENOMEM, "%s needs %s of memory, but %s is available (%s): nothing was "
                     "allocated", what, kt_format_bytes(bytes, need, sizeof need),
                     kt_format_bytes(avail, have, sizeof have), source);
}
