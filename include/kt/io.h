/* Reading and writing safetensors, the format PyTorch and Hugging Face write.
 *
 * A safetensors file is an 8-byte little-endian header length N, N bytes of JSON mapping each
 * tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
 * byte after the header) plus an optional "__metadata__" object of string values, then the
 * raw little-endian tensor bytes. libkt holds F32, BF16, F16, I32 and I64 tensors of up to
 * KT_MAX_DIMS dimensions, and converts F64 into a float dtype (kt_st_read_convert); a file
 * may hold tensors of the format's other dtypes (I8, U8, BOOL, F8_E4M3, ...): it opens, and
 * those tensors are refused (KT_EUNSUPPORTED, naming the file, the tensor and its dtype)
 * where they are read or viewed. The header is parsed by a bounded parser, and anything
 * malformed, truncated or inconsistent is rejected with KT_EFORMAT and a message naming the
 * file, the tensor and what is wrong; more dimensions are KT_EUNSUPPORTED.
 *
 * As the format's specification requires, the tensors must cover the data section exactly:
 * a gap, an overlap or trailing bytes after the last tensor are all KT_EFORMAT (a file with
 * unaccounted bytes could smuggle other content). Names and metadata must be valid UTF-8
 * without NUL characters.
 *
 * A sharded checkpoint (Hugging Face's `model.safetensors.index.json`: {"metadata": {...},
 * "weight_map": {tensor name: shard file name}} beside the shards) opens as one kt_st_file
 * that spans every shard; see kt_st_open.
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

/* Opens a checkpoint. `path` is one of:
 *   - a safetensors file: opened with kt_in_open below (a regular file or an anonymous pipe;
 *     a named FIFO or a device is refused without waiting), mapped read-only (or read, where
 *     it cannot be mapped: pipes), its header parsed;
 *   - an index, a path ending in ".json" (`*.safetensors.index.json`): every shard its
 *     weight_map names (relative to the index's directory) is opened as above;
 *   - a directory: its `model.safetensors.index.json` when there is one, else its
 *     `model.safetensors` (neither is KT_EIO naming both).
 * The result spans all shards: kt_st_count, kt_st_entry, kt_st_find, kt_st_read and
 * kt_st_metadata work across them, entries in shard-name order, each shard's in header order.
 * An index is checked whole before the open succeeds (KT_EFORMAT, naming the index, the shard
 * and the tensor): it must be a JSON object with a "weight_map" object of string values; a
 * shard name must be relative without a ".." component (it cannot leave the directory); each
 * shard must open and pass the checks above (a missing or unreadable shard is KT_EIO); every
 * tensor the index maps to a shard must be in that shard, and every tensor of a shard must be
 * listed, for that shard, and in no other shard.
 * A mapped file must not be truncated while it is open: the views would then point at pages
 * that no longer exist (SIGBUS). Errors name the path; failures to open or read are KT_EIO
 * with the system's reason. On failure *file_out is NULL (so is kt_st_open_memory's and
 * kt_out_open's). Views and names from the file live until kt_st_close. */
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
 * kt_st_read before computing on it. A tensor of a dtype libkt has not (F64, F8_E4M3, ...)
 * has no view: asking for one is KT_EUNSUPPORTED (its name alone is fine). kt_st_find the
 * same. */
kt_status kt_st_entry(const kt_st_file *file, size_t i, const char **name_out,
                      kt_tensor *view_out);
/* KT_EINVAL "no tensor named ..." when absent. */
kt_status kt_st_find(const kt_st_file *file, const char *name, kt_tensor *view_out);
/* Copies the named tensor into dst, which must have the same dtype and shape (the message
 * names the tensor, the file's dtype/shape and dst's) and be contiguous. Once copied, the
 * pages wholly inside the tensor's bytes are given back (madvise MADV_DONTNEED on a mapped
 * file): loading N bytes costs about N bytes of memory, not 2N. A view of the tensor stays
 * valid; touching it reads the pages again. */
kt_status kt_st_read(const kt_st_file *file, const char *name, kt_tensor *dst);
/* kt_st_read converting floats: a tensor stored as F32, BF16, F16 or F64 is read into a
 * contiguous CPU destination of dtype f32, bf16 or f16 of the same shape, rounded to nearest
 * even (exact where the destination holds every value: bf16 and f16 into f32; NaN stays NaN,
 * overflow goes to infinity). The same dtype is a plain copy (any dtype). Anything else (an
 * integer into a float, a float into an integer, F8_E4M3, ...) is KT_EUNSUPPORTED naming the
 * file, the tensor and both dtypes. Pages are given back as kt_st_read does. */
kt_status kt_st_read_convert(const kt_st_file *file, const char *name, kt_tensor *dst);
/* Checks, copying nothing, what kt_st_read_convert into dst would check: the tensor exists
 * (else KT_EINVAL "no tensor named ..."), has dst's shape and converts to dst's dtype. dst's
 * data may be NULL. */
kt_status kt_st_check_convert(const kt_st_file *file, const char *name, const kt_tensor *dst);
/* The value of a metadata key, or NULL: for a sharded checkpoint the index's "metadata"
 * (string values, and integers as their decimal text: "total_size") first, then the shards'
 * "__metadata__" in shard order; for a file its "__metadata__". */
const char *kt_st_metadata(const kt_st_file *file, const char *key);

/* ---- what is where: tensors of any dtype, and the shards they are in ------------------------ */

typedef struct kt_st_info {
    const char *name;
    const char *file_dtype; /* the format's spelling: "F32", "BF16", "F64", "F8_E4M3", ... */
    kt_dtype dtype;         /* KT_DTYPE_COUNT where libkt has no such dtype */
    int ndim;
    int64_t shape[KT_MAX_DIMS];
    size_t nbytes;
    size_t shard; /* index for kt_st_shard_name / kt_st_shard_path */
    uint64_t file_offset; /* where its bytes begin in that shard's file (for readers that
                             stream a tensor from the file instead of mapping it) */
} kt_st_info;

/* The i-th tensor's description, whatever its dtype (kt_st_entry needs a libkt dtype for its
 * view). */
kt_status kt_st_entry_info(const kt_st_file *file, size_t i, kt_st_info *info_out);
/* The position (for kt_st_entry, kt_st_entry_info) of the named tensor; KT_EINVAL "no tensor
 * named ..." when absent. */
kt_status kt_st_lookup(const kt_st_file *file, const char *name, size_t *index_out);
/* 1 when the file was opened from an index (a sharded checkpoint), else 0. */
int kt_st_is_sharded(const kt_st_file *file);
/* The shards: 1 for a file. A shard's name is the file name as the index gives it
 * ("model-00001-of-00002.safetensors"), for a file its path's last component; its path is
 * the one opened. NULL out of range. */
size_t kt_st_shard_count(const kt_st_file *file);
const char *kt_st_shard_name(const kt_st_file *file, size_t k);
const char *kt_st_shard_path(const kt_st_file *file, size_t k);
/* The name of the shard that holds the i-th tensor; NULL out of range. */
const char *kt_st_entry_file(const kt_st_file *file, size_t i);

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
/* Writes the file through kt_out_open/kt_out_commit below: `path` ends up holding the whole
 * new file or, on any failure, exactly what it held before. */
kt_status kt_st_save(const char *path, const kt_st_item *items, size_t n,
                     const char *const *metadata);

/* ---- output files: whole or not at all -------------------------------------------------------
 *
 * Every file libkt writes (safetensors, programs, traces) goes through this writer, and tools
 * and applications may use it for their own. The data goes to a temporary file in the same
 * directory as `path`; kt_out_commit syncs it and renames it over `path` in one step, so a
 * reader, a crash, Ctrl-C, kill -9 or a full disk sees either the old file or the new one,
 * never a mix or a truncated file.
 *
 * The temporary is an unnamed file (O_TMPFILE) where the filesystem allows, which vanishes by
 * itself when the process dies; it gets a name only for the instant between the last sync and
 * the rename. Elsewhere it is a hidden ".NAME.kt-tmp.PID.N" beside the target; kt_out_open
 * removes such files left by processes that no longer exist (by PID; a temporary written from
 * another PID namespace is left alone), so a killed writer leaves nothing lasting behind.
 *
 * kt_out_open refuses (KT_EINVAL, naming the path and what it is) a path that exists and is not
 * a regular file: a symbolic link, a device, a FIFO, a socket or a directory is never replaced
 * or written through. A new file gets the mode a plain create gives (0666 less the umask); a
 * replaced one keeps its permission bits. Errors name the path and the system's reason (KT_EIO,
 * "No space left on device"; a missing directory says so). Not for use by several threads on
 * one kt_out_file at once. */
typedef struct kt_out_file kt_out_file;

kt_status kt_out_open(const char *path, kt_out_file **file_out);
/* Appends n bytes (any size; short writes and EINTR are retried). A failure is remembered:
 * kt_out_commit then fails too, so a writer may check only the commit. */
kt_status kt_out_write(kt_out_file *f, const void *data, size_t n);
/* Appends formatted text (buffered; for text writers: traces, Graphviz). */
kt_status kt_out_printf(kt_out_file *f, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* Flushes, syncs the data, renames the temporary over the path and syncs the directory. It
 * frees f whatever happens: on failure the temporary is removed and the path is untouched
 * (only a failure to sync the directory, reported too, comes after the path holds the new
 * file). */
kt_status kt_out_commit(kt_out_file *f);
/* Abandons the file: removes the temporary, leaves the path as it was, frees f. NULL is
 * fine. */
void kt_out_discard(kt_out_file *f);

/* ---- input files: never blocking -------------------------------------------------------------
 *
 * Opens `path` for reading (close-on-exec) without waiting: the open itself never blocks, and
 * only what can be read to an end is accepted: regular files, and anonymous pipes (a shell's
 * `<(...)` or `|`, whose writer already exists). A named FIFO (which would wait for a writer
 * that may never come), a directory, a device or a socket is refused with KT_EINVAL naming the
 * path and what it is; other failures are KT_EIO with the system's reason. kt_st_open and
 * kt_program_load open their files this way. The descriptor is blocking again on return;
 * *is_regular_out (may be NULL) says whether it is a regular file. */
kt_status kt_in_open(const char *path, int *fd_out, int *is_regular_out);

#ifdef __cplusplus
}
#endif
#endif
