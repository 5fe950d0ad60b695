/* Internal to the file openers (lib/io/out_file.c, in_file.c), and what tests need to reach
 * the writer's fallback. */
#ifndef KT_IO_OUT_FILE_H
#define KT_IO_OUT_FILE_H

#include <sys/stat.h>

/* What a file that is not a regular one is, for messages: "a symbolic link", "a named FIFO" */
const char *kt__file_kind(mode_t m);

/* Nonzero: kt_out_open makes named temporaries (the fallback for filesystems without
 * O_TMPFILE) even where unnamed ones are available, so tests can exercise that path. */
extern int kt__out_force_named;

#endif
