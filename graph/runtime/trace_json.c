/* Chrome trace-event JSON ("X" complete events), readable by chrome://tracing and Perfetto. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "core/error.h"
#include "kt/program.h"

static void put_json_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

kt_status kt_trace_write_json(const kt_trace_event *events, size_t n, const char *path)
{
    if ((events == NULL && n > 0) || path == NULL)
        return kt__error(KT_EINVAL, "kt_trace_write_json: NULL argument");
    FILE *f = fopen(path, "w");
    if (f == NULL)
        return kt__error(KT_EIO, "%s: cannot open for writing: %s", path, strerror(errno));
    uint64_t base = n > 0 ? events[0].start_ns : 0;
    for (size_t i = 0; i < n; i++)
        if (events[i].start_ns < base)
            base = events[i].start_ns;
    fputs("{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n", f);
    for (size_t i = 0; i < n; i++) {
        const kt_trace_event *e = &events[i];
        fputs(i ? ",\n{\"name\":" : "{\"name\":", f);
        put_json_string(f, e->name && e->name[0] ? e->name : "(unnamed)");
        fputs(",\"cat\":", f);
        put_json_string(f, e->category);
        fprintf(f, ",\"ph\":\"X\",\"pid\":0,\"tid\":0,\"ts\":%.3f,\"dur\":%.3f,"
                   "\"args\":{\"step\":%d}}",
                (double)(e->start_ns - base) / 1000.0,
                (double)(e->end_ns - e->start_ns) / 1000.0, e->step);
    }
    fputs("\n]}\n", f);
    if (ferror(f)) {
        fclose(f);
        return kt__error(KT_EIO, "%s: write failed", path);
    }
    if (fclose(f) != 0)
        return kt__error(KT_EIO, "%s: close failed: %s", path, strerror(errno));
    return KT_OK;
}
