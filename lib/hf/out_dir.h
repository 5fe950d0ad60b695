/* The output directory, written whole or not at all (out_dir.c says how). */
#ifndef KT_HF_OUT_DIR_H
#define KT_HF_OUT_DIR_H

#include <stddef.h>

#include "kt/status.h"

typedef struct kt__hf_out {
    char out[3072], tmp[3200], old[3200];
    int existed; /* OUT holds an earlier import's files */
} kt__hf_out;

/* Checks OUT (absent, empty, or an earlier import: else refused) and creates the temporary
 * directory beside it. */
kt_status kt__hf_out_begin(const char *out_dir, kt__hf_out *o);
/* Where `file` goes in the temporary directory. */
void kt__hf_out_path(const kt__hf_out *o, const char *file, char *buf, size_t size);
/* Moves the temporary directory onto OUT; on failure removes it and leaves OUT as it was. */
kt_status kt__hf_out_commit(kt__hf_out *o);
/* Removes the temporary directory (nothing of OUT changes). */
void kt__hf_out_abort(kt__hf_out *o);

#endif
