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

/* Opens the file with kt_in_open below (a regular file or an anonymous pipe; a named FIFO, a
 * device or a directory is refused without waiting), maps it read-only (or reads it, where it
 * cannot be mapped: pipes) and parses its header. A mapped file must not be truncated while it is open: the views
 * would then point at pages that no longer exist (SIGBUS). Errors name the path; failures
 * to open or read are KT_EIO with the system's reason. On failure *file_out is NULL (so is
 * kt_st_open_memory's and kt_out_open's). Views and names from the file live until
 * kt_st_close. */
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
