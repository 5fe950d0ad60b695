/* Shared by the command-line tools: the usage-error message and exit status. */
#ifndef KT_TOOLS_USAGE_H
#define KT_TOOLS_USAGE_H

/* Prints "TOOL: " fmt (printf-style) and a pointer to TOOL --help on stderr; returns 2, the
 * tools' usage-error exit status. */
int kt_tool_usage_error(const char *tool, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif
