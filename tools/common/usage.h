/* Shared by the command-line tools: the usage-error message and exit status. */
#ifndef KT_TOOLS_USAGE_H
#define KT_TOOLS_USAGE_H

/* Prints "TOOL: " fmt (printf-style) and a pointer to TOOL --help on stderr; returns 2, the
 * tools' usage-error exit status. */
int kt_tool_usage_error(const char *tool, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Parses v, the value of option opt, as a whole decimal number in [lo, hi]: "2abc",
 * "99999999999" (out of range), " 5" and "" are refused. 0 with *out set, or 2 after printing
 * "TOOL: OPT needs a whole number from LO to HI, not 'V'" (">= LO" for hi LLONG_MAX). */
int kt_tool_parse_int(const char *tool, const char *opt, const char *v, long long lo,
                      long long hi, long long *out);

/* kt_tool_parse_real's open ends of the range. */
enum { KT_TOOL_LO_OPEN = 1, KT_TOOL_HI_OPEN = 2 };

/* Parses v, the value of option opt, as a decimal number in [lo, hi] (an end in `open`
 * excluded; hi HUGE_VAL: no upper bound): "", " 5", "+5", "1x", "nan" and "inf" are refused. 0
 * with *out set, or 2 after printing "TOOL: OPT needs a number > LO and <= HI, not 'V'". */
int kt_tool_parse_real(const char *tool, const char *opt, const char *v, double lo, double hi,
                       int open, double *out);

/* Flushes stdout and checks it for write errors (a full disk, a closed pipe): prints
 * "TOOL: cannot write to standard output: <reason>" and returns 1, else 0. Every tool's main
 * returns through it, so that `tool > /dev/full` does not exit 0. */
int tool_finish_stdout(const char *tool);

/* The process's peak resident memory so far in MB (10^6 bytes; getrusage's ru_maxrss, which
 * is VmHWM on Linux), or a negative value where the system does not say. */
double tool_peak_rss_mb(void);

#endif
