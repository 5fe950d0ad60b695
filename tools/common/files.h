/* Shared by the command-line tools: opening inputs, checking that no output overwrites an
 * input, and reporting a failed standard output. Messages go to stderr as "TOOL: ..."; the
 * functions return the tools' exit statuses (0, 1 an error, 2 a usage error). */
#ifndef KT_TOOLS_FILES_H
#define KT_TOOLS_FILES_H

#include "tools/common/usage.h" /* tool_finish_stdout */

/* Opens path for reading through kt_in_open (kt/io.h): never blocking in open(), a regular
 * file or an anonymous pipe (`<(...)`) only; a named FIFO, a directory or a device is refused.
 * On failure prints "TOOL: cannot read WHAT: <reason naming the path>" and returns 1. */
int tool_open_input(const char *tool, const char *what, const char *path, int *fd_out);

typedef struct tool_path {
    const char *option; /* as the user wrote it: "--data", "-o", "the model file" */
    const char *path;   /* NULL: not given, skipped */
    int is_output;
} tool_path;

/* Refuses (usage error, 2) an output that is the same file as an input or as another output:
 * the same (device, inode) where the file exists (symbolic and hard links count), the same
 * directory and name where it does not yet. Prints, e.g., "kt-train: --losses names the same
 * file as --data (data.bin): an output must not overwrite an input". 0 when all differ. */
int tool_check_paths(const char *tool, const tool_path *entries, int n);

/* Checked before any work, so that a run does not end in a refusal it could have had at
 * once: whether `path` can be written (kt_out_open, then discarded: the target is not
 * touched), and whether it opens as safetensors (a missing, empty or damaged file). NULL
 * paths pass. Each prints "TOOL: cannot write|read WHAT: <reason>" and returns 1, else 0. */
int tool_probe_output(const char *tool, const char *what, const char *path);
int tool_probe_safetensors(const char *tool, const char *what, const char *path);


#endif
