/* Internal to the output writer (lib/io/out_file.c): what tests need to reach the fallback. */
#ifndef KT_IO_OUT_FILE_H
#define KT_IO_OUT_FILE_H

/* Nonzero: kt_out_open makes named temporaries (the fallback for filesystems without
 * O_TMPFILE) even where unnamed ones are available, so tests can exercise that path. */
extern int kt__out_force_named;

#endif
