/* Little-endian byte writing and bounds-checked reading, and CRC-32, for the .ktp format. */
#ifndef KT_GRAPH_RUNTIME_BYTES_H
#define KT_GRAPH_RUNTIME_BYTES_H

#include <stddef.h>
#include <stdint.h>

/* A writer with buf == NULL only counts (to size the output). */
typedef struct kt__writer {
    unsigned char *buf;
    size_t pos, cap;
} kt__writer;

void kt__put_u32(kt__writer *w, uint32_t v);
void kt__put_u64(kt__writer *w, uint64_t v);
void kt__put_i32(kt__writer *w, int32_t v);
void kt__put_i64(kt__writer *w, int64_t v);
void kt__put_f32(kt__writer *w, float v);
void kt__put_f64(kt__writer *w, double v);
void kt__put_bytes(kt__writer *w, const void *p, size_t n);

/* A reader that fails sticky: after the first read past the end every read returns 0 and
 * `bad` stays set, so callers check once per record. */
typedef struct kt__reader {
    const unsigned char *buf;
    size_t pos, size;
    int bad;
} kt__reader;

uint32_t kt__get_u32(kt__reader *r);
uint64_t kt__get_u64(kt__reader *r);
int32_t kt__get_i32(kt__reader *r);
int64_t kt__get_i64(kt__reader *r);
float kt__get_f32(kt__reader *r);
double kt__get_f64(kt__reader *r);
/* Pointer to the next n bytes (NULL and bad set if fewer remain). */
const unsigned char *kt__get_bytes(kt__reader *r, size_t n);

uint32_t kt__crc32(const void *data, size_t n);

#endif
