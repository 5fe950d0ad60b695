/* Chrome trace-event JSON ("X" complete events), readable by chrome://tracing and Perfetto. */
#include <stdio.h>

#include "lib/core/error.h"
#include "kt/io.h"
#include "kt/program.h"

/* Write failures are remembered by the writer and reported by kt_out_commit. */
static void put_json_string(kt_out_file *f, const char *s)
{
    kt_out_write(f, "\"", 1);
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            kt_out_printf(f, "\\%c", c);
        else if (c < 0x20)
            kt_out_printf(f, "\\u%04x", c);
        else
            kt_out_write(f, &c, 1);
    }
    kt_out_write(f, "\"", 1);
}

kt_status kt_trace_write_json(const kt_trace_event *events, size_t n, const char *path)
{
    if ((events == NULL && n > 0) || path == NULL)
        return kt__error(KT_EINVAL, "kt_trace_write_json: NULL argument");
    kt_out_file *f = NULL;
    KT__TRY(kt_out_open(path, &f));
    uint64_t base = n > 0 ? events[0].start_ns : 0;
    for (size_t i = 0; i < n; i++)
        if (events[i].start_ns < base)
            base = events[i].start_ns;
    kt_out_printf(f, "%s", "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n");
    for (size_t i = 0; i < n; i++) {
        const kt_trace_event *e = &events[i];
        kt_out_printf(f, "%s", i ? ",\n{\"name\":" : "{\"name\":");
        put_json_string(f, e->name && e->name[0] ? e->name : "(unnamed)");
        kt_out_printf(f, "%s", ",\"cat\":");
        put_json_string(f, e->category);
        kt_out_printf(f, ",\"ph\":\"X\",\"pid\":0,\"tid\":0,\"ts\":%.3f,\"dur\":%.3f,"
                         "\"args\":{\"step\":%d}}",
                      (double)(e->start_ns - base) / 1000.0,
                      (double)(e->end_ns - e->start_ns) / 1000.0, e->step);
    }
    kt_out_printf(f, "%s", "\n]}\n");
    return kt_out_commit(f);
}
