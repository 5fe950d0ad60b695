#include "common/usage.h"

#include <stdarg.h>
#include <stdio.h>

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
