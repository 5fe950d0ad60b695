/* Reading and writing safetensors, the format PyTorch and Hugging Face write.
 *
 * A safetensors file is an 8-byte little-endian header length N, N bytes of JSON mapping each
 * tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
 * byte after the header) plus an optional "__metadata__" object of string values, then the
 * raw little-endian tensor bytes. libkt reads F32, BF16, F16, I32 and I64 tensors of up to
 * KT_MAX_DIMS dimensions; the header is parsed by a bounded parser, and anything malformed,
 * truncated or inconsistent is rejected with KT_EFORMAT and a message naming the file, the
 * tensor and what is wrong. Valid files with other dtypes (F64, I8, U8, BOOL, ...) or more
 * dimensions are rejected with KT_EUNSUPPORTED.
 *
 * As the format's specification requires, the tensors must cover the data section exactly:
 * a gap, an overlap or trailing bytes after the last tensor are all KT_EFORMAT (a file with
 * unaccounted bytes could smuggle other content). Names and metadata must be valid UTF-8
 * without NUL characters.
 */
#ifndef KT_IO_H
#define KT_IO_H

#include <stddef.h>

#include "status.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest header accepted (the format's own limit is 100 MB). */
#define KT_ST_MAX_HEADER (100u * 1000u * 1000u)

typedef struct kt_st_file kt_st_file;

/* Maps the file read-only (or reads it, where it cannot be mapped: pipes, special files)
 * and parses its header. A mapped file must not be truncated while it is open: the views
 * would then point at pages that no longer exist (SIGBUS). Errors name the path; failures
 * to open or read are KT_EIO with the system's reason. */
kt_status kt_st_open(const char *path, kt_st_file **file_out);
/* Parses a file image in memory without copying it: `data` must outlive the kt_st_file.
 * `label` names the buffer in error messages (may be NULL). */
kt_status kt_st_open_memory(const void *data, size_t size, const char *label,
                            kt_st_file **file_out);
void kt_st_close(kt_st_file *file);

size_t kt_st_count(const kt_st_file *file);
/* The i-th tensor in header order: its name and a view over the file's bytes (either output
 * may be NULL). Both live as long as the file. The view is read-only (a mapping is mapped
 * without write access) and its data may be unaligned for its dtype: copy it out with
 * kt_st_read before computing on it. */
kt_status kt_st_entry(const kt_st_file *file, size_t i, const char **name_out,
                      kt_tensor *view_out);
/* KT_EINVAL "no tensor named ..." when absent. */
kt_status kt_st_find(const kt_st_file *file, const char *name, kt_tensor *view_out);
/* Copies the named tensor into dst, which must have the same dtype and shape (the message
 * names the tensor, the file's dtype/shape and dst's) and be contiguous. */
kt_status kt_st_read(const kt_st_file *file, const char *name, kt_tensor *dst);
/* The value of a "__metadata__" key, or NULL. */
const char *kt_st_metadata(const kt_st_file *file, const char *key);

typedef struct kt_st_item {
    const char *name;
    kt_tensor tensor; /* contiguous CPU tensor */
} kt_st_item;

/* metadata: NULL, or a NULL-terminated list of key, value, key, value, ..., NULL.
 *
 * The writers emit "__metadata__" first, then the tensors in the given order with contiguous
 * data offsets, and pad the header with spaces so the data starts 8-byte aligned. They reject
 * (KT_EINVAL) NULL, duplicate, reserved ("__metadata__") or non-UTF-8 names, duplicate
 * metadata keys, and tensors that are not contiguous, not on the CPU or have no data. */
kt_status kt_st_serialized_size(const kt_st_item *items, size_t n, const char *const *metadata,
                                size_t *bytes_out);
/* Writes the file image into buf (at least kt_st_serialized_size bytes). */
kt_status kt_st_serialize(const kt_st_item *items, size_t n, const char *const *metadata,
                          void *buf, size_t size);
/* Writes the file atomically: a temporary file next to `path`, synced, then renamed over it;
 * on failure the temporary file is removed and `path` is unchanged. */
kt_status kt_st_save(const char *path, const kt_st_item *items, size_t n,
                     const char *const *metadata);

#ifdef __cplusplus
}
#endif
#endif
