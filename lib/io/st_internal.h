/* The safetensors reader's insides, shared by the single-file reader (safetensors.c), the
 * sharded checkpoint (st_sharded.c) and the converting read (st_convert.c).
 *
 * A kt_st_file is one or more shards: one for a .safetensors file, one per file an index
 * names for a sharded checkpoint. Its entries are the shards' entries one after the other
 * (shards in name order, each in header order); by_name sorts them all for lookup. */
#ifndef KT_IO_ST_INTERNAL_H
#define KT_IO_ST_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kt/io.h"
#include "lib/io/json.h"

/* Names in messages are cut to this many bytes so the context around them survives. */
#define KT__ST_NAME_SHOWN 200

typedef struct kt__st_entry {
    const char *name;       /* points into its shard's parsed header */
    const char *file_dtype; /* the format's spelling: "F32", "F64", "F8_E4M3", ... */
    int has_view;           /* 1 when dtype below holds it (a libkt dtype) */
    kt_dtype dtype;
    unsigned bits;          /* per element */
    int ndim;
    int64_t shape[KT_MAX_DIMS];
    uint64_t begin, end; /* relative to the start of its shard's data section */
    size_t shard;
} kt__st_entry;

typedef struct kt__st_shard {
    char *path;       /* as opened, for messages */
    const char *name; /* as the index names it; else the path's last component */
    const unsigned char *data; /* the data section */
    size_t data_size;
    size_t data_offset; /* where the data section begins in the file: 8 + the header */
    void *mapped; /* munmap'ed on close, when the file was mapped */
    size_t mapped_size;
    void *owned; /* freed on close: a file read into memory */
    kt__json_doc *doc;
    const kt__json_value **meta; /* __metadata__ members sorted by key */
    size_t meta_count;
    kt__st_entry *entries; /* header order; moved into the file by kt__st_assemble */
    size_t count;
} kt__st_shard;

struct kt_st_file {
    char *label; /* the file, the index or the directory's file: what messages name */
    kt__st_shard *shards;
    size_t n_shards;
    kt__st_entry *entries;
    size_t count;
    const kt__st_entry **by_name;
    int sharded;            /* opened from an index */
    kt__json_doc *index;    /* the index, kept for the names and metadata pointing into it */
    const char **index_meta; /* key, value, ...: the index's "metadata" (integers as text) */
    size_t index_meta_count; /* pairs */
    char *index_meta_text;   /* the integers' text */
};

/* Opens one safetensors file (mapped, or read where it cannot be) into *shard, which it
 * cleans up on failure. */
kt_status kt__st_shard_open(const char *path, kt__st_shard *shard);
/* Parses an image in memory (not copied) as one shard labelled `label`. */
kt_status kt__st_shard_parse(const unsigned char *image, size_t size, const char *label,
                             kt__st_shard *shard);
void kt__st_shard_free(kt__st_shard *shard);

/* Takes over f->shards (already in f) and builds f->entries and f->by_name; a tensor in
 * two shards (or twice in one) is KT_EFORMAT naming both. */
kt_status kt__st_assemble(kt_st_file *f);

/* The sharded checkpoint behind an index file. */
kt_status kt__st_open_index(const char *index_path, kt_st_file **file_out);
/* The same with the index's text in memory and the shards' directory given (the fuzzer's
 * way in). */
kt_status kt__st_open_index_text(const char *text, size_t len, const char *label,
                                 const char *dir, kt_st_file **file_out);

const kt__st_entry *kt__st_find_entry(const kt_st_file *file, const char *name);
/* The shard's path, for messages about the entry. */
const char *kt__st_entry_path(const kt_st_file *file, const kt__st_entry *e);
const unsigned char *kt__st_entry_data(const kt_st_file *file, const kt__st_entry *e);
/* Gives the pages wholly inside the entry's bytes back to the system (a mapped shard only):
 * once copied out, they need not stay resident. A later access reads them again. */
void kt__st_release(const kt_st_file *file, const kt__st_entry *e);
/* "F64[2,3]" for messages. */
char *kt__st_describe(const kt__st_entry *e, char *buf, size_t size);

#endif
