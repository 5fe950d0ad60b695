/* Shared by the command-line tools: the usage-error message and exit status. */
#ifndef KT_TOOLS_USAGE_H
#define KT_TOOLS_USAGE_H

/* Prints "TOOL: " fmt (with arg) and a pointer to TOOL --help on stderr; returns 2, the
 * tools' usage-error exit status. */
int kt_tool_usage_error(const char *tool, const char *fmt, const char *arg);

#endif
