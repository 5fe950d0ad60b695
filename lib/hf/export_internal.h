/* Shared by the export files (lib/hf/export_*.c): the output directory, the run's adapters,
 * values between dtypes. */
#ifndef KT_HF_EXPORT_INTERNAL_H
#define KT_HF_EXPORT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kt/hf_export.h"
#include "kt/io.h"
#include "kt/tensor.h"

#define KT__HF_NAME_BYTES 512

/* ---- the output directory (export_dir.c) ---------------------------------------------------- */

typedef struct kt__xdir {
    char final[KT_HF_EXPORT_PATH_BYTES];
    char tmp[KT_HF_EXPORT_PATH_BYTES];
    int created;
} kt__xdir;

/* Refuses an out_dir that exists; creates the hidden temporary sibling ".NAME.kt-tmp.PID". */
kt_status kt__xdir_begin(kt__xdir *d, const char *out_dir);
/* buf = the temporary directory's path joined with name. */
kt_status kt__xdir_path(const kt__xdir *d, const char *name, char *buf, size_t size);
/* Renames the temporary directory into place and syncs the parent. */
kt_status kt__xdir_commit(kt__xdir *d);
/* Removes the temporary directory and what is in it (no-op after commit or before begin). */
void kt__xdir_abort(kt__xdir *d);

/* dir/name into buf; KT_EINVAL when it does not fit. */
kt_status kt__path_join(char *buf, size_t size, const char *dir, const char *name);
int kt__path_exists(const char *path);
/* Copies a file byte for byte (through kt_out_open: whole or not at all). */
kt_status kt__copy_file(const char *src, const char *dst);
/* The whole file into a NUL-terminated heap buffer (free it); at most max_bytes. */
kt_status kt__read_text(const char *path, size_t max_bytes, char **text_out, size_t *len_out);

/* ---- the run's adapters (export_adapters.c) -------------------------------------------------- */

typedef struct kt__adapter {
    char module[KT__HF_NAME_BYTES]; /* "model.layers.0.self_attn.q_proj" */
    kt_tensor a, b;                 /* views into the run file, [r, in] and [out, r] f32 */
    int64_t layer;                  /* routed experts: the layer, else -1 */
    int64_t expert;                 /* routed experts: the expert */
    int proj;                       /* routed experts: 0 gate, 1 up, 2 down */
    int mixtral;                    /* routed experts under block_sparse_moe.experts.<e>.w1/w3/w2 */
} kt__adapter;

typedef struct kt__adapters {
    kt__adapter *items;
    size_t n;
    int64_t rank; /* 0 when there are none */
} kt__adapters;

/* Every "<module>.lora_A.weight" / ".lora_B.weight" pair of the run ("optimizer.*" and
 * "grad.*" skipped):
 * each A needs its B, f32, 2-D, one rank for all (options->lora_rank when given), and with
 * options->targets each module's last name component (or "experts" for a routed expert's)
 * among the targets and each target used. */
kt_status kt__adapters_find(const kt_st_file *run, const char *run_path,
                            const kt_hf_export_options *options, kt__adapters *out);
void kt__adapters_free(kt__adapters *a);
/* The adapter of module (the tensor name without ".weight"), or NULL. */
const kt__adapter *kt__adapters_lookup(const kt__adapters *a, const char *module);

/* ---- values (export_values.c) ------------------------------------------------------------------ */

/* Element i of a (possibly unaligned) float tensor view as a double. */
double kt__elem_get(const kt_tensor *view, size_t i);
/* Stores x in dtype at dst (F32, BF16, F16: rounded once, to nearest even). */
void kt__elem_put(double x, kt_dtype dtype, void *dst);
/* The adapter's A and B as doubles (A [r, in] then B [out, r], one allocation). */
kt_status kt__adapter_values(const kt__adapter *a, double **values_out);

/* A safetensors file streamed tensor by tensor: the header first, then each tensor's bytes,
 * so writing a shard holds one row of it in memory, not the shard (export_values.c). */
typedef struct kt__st_header_item {
    const char *name;
    kt_dtype dtype;
    int ndim;
    int64_t shape[KT_MAX_DIMS];
} kt__st_header_item;
kt_status kt__st_write_header(kt_out_file *f, const kt__st_header_item *items, size_t n,
                              const char *path);

/* ---- the source checkpoint (export_source.c) -------------------------------------------------- */

#define KT__HF_SHARD_NAME_BYTES 256

typedef struct kt__source {
    const char *dir;
    int indexed; /* sharded, with model.safetensors.index.json */
    size_t n_shards;
    char (*shard_names)[KT__HF_SHARD_NAME_BYTES];
    kt_st_file **shards;
    /* the index's weight_map in its order (indexed only): names and their shard */
    size_t n_mapped;
    char **mapped_names;
    size_t *mapped_shard;
} kt__source;

/* Opens dir's model.safetensors.index.json and every shard it names, or dir's
 * model.safetensors; checks that the index and the shards agree (every tensor mapped to the
 * shard that holds it, every shard and tensor of the index there). */
kt_status kt__source_open(const char *dir, kt__source *out);
void kt__source_close(kt__source *s);
/* The source tensor of that name: KT_OK with the view, or KT_EINVAL (message set). */
kt_status kt__source_find(const kt__source *s, const char *name, kt_tensor *view_out);

/* Writes s as a JSON string literal (quotes and escapes). */
kt_status kt__out_json_string(kt_out_file *f, const char *s);

#endif
