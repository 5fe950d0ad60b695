#include "tools/common/usage.h"

#include <errno.h>
#include <math.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

int kt_tool_usage_error(const char *tool, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", tool);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n(see %s --help)\n", tool);
    return 2;
}

int kt_tool_parse_int(const char *tool, const char *opt, const char *v, long long lo,
                      long long hi, long long *out)
{
    char *end = NULL;
    errno = 0;
    /* strtoll alone would skip leading blanks and accept a '+' */
    const int starts = (v[0] >= '0' && v[0] <= '9') || (v[0] == '-' && v[1] >= '0' && v[1] <= '9');
    long long x = starts ? strtoll(v, &end, 10) : 0;
    if (!starts || errno != 0 || *end != '\0' || x < lo || x > hi) {
        if (lo == LLONG_MIN && hi == LLONG_MAX)
            return kt_tool_usage_error(tool, "%s needs a whole number, not '%s'", opt, v);
        if (hi == LLONG_MAX)
            return kt_tool_usage_error(tool, "%s needs a whole number >= %lld, not '%s'", opt, lo,
                                       v);
        return kt_tool_usage_error(tool, "%s needs a whole number from %lld to %lld, not '%s'", opt,
                                   lo, hi, v);
    }
    *out = x;
    return 0;
}

int kt_tool_parse_real(const char *tool, const char *opt, const char *v, double lo, double hi,
                       int open, double *out)
{
    char *end = NULL;
    /* strtod alone would skip leading blanks and take '+', "inf" and hex */
    const char *digits = v[0] == '-' ? v + 1 : v;
    const int starts = (digits[0] >= '0' && digits[0] <= '9') || digits[0] == '.';
    const int hex = digits[0] == '0' && (digits[1] == 'x' || digits[1] == 'X');
    double x = starts && !hex ? strtod(v, &end) : NAN;
    const int in_lo = (open & KT_TOOL_LO_OPEN) ? x > lo : x >= lo;
    const int in_hi = (open & KT_TOOL_HI_OPEN) ? x < hi : x <= hi;
    if (end == NULL || *end != '\0' || !isfinite(x) || !in_lo || !in_hi) {
        const char *gt = (open & KT_TOOL_LO_OPEN) ? ">" : ">=";
        const char *lt = (open & KT_TOOL_HI_OPEN) ? "<" : "<=";
        if (hi == HUGE_VAL)
            return kt_tool_usage_error(tool, "%s needs a number %s %g, not '%s'", opt, gt, lo, v);
        return kt_tool_usage_error(tool, "%s needs a number %s %g and %s %g, not '%s'", opt, gt,
                                   lo, lt, hi, v);
    }
    *out = x;
    return 0;
}

int tool_finish_stdout(const char *tool)
{
    errno = 0;
    int flushed = fflush(stdout) == 0;
    int err = errno;
    if (flushed && !ferror(stdout))
        return 0;
    fprintf(stderr, "%s: cannot write to standard output: %s\n", tool,
            err != 0 ? strerror(err) : "an earlier write failed");
    return 1;
}

double tool_peak_rss_mb(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0 || ru.ru_maxrss <= 0)
        return -1.0;
#if defined(__APPLE__)
    return (double)ru.ru_maxrss / 1e6; /* bytes there */
#else
    return (double)ru.ru_maxrss * 1024.0 / 1e6; /* kilobytes on Linux and the BSDs */
#endif
}
