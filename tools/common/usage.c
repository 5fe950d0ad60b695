#include "common/usage.h"

#include <stdio.h>

int kt_tool_usage_error(const char *tool, const char *fmt, const char *arg)
{
    fprintf(stderr, "%s: ", tool);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n(see %s --help)\n", tool);
    return 2;
}
