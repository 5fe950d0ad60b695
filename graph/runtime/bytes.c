/* Little-endian encoding and CRC-32 (IEEE 802.3, the zlib polynomial). */
#include <string.h>

#include "graph/runtime/bytes.h"

static void put(kt__writer *w, uint64_t v, int n)
{
    if (w->buf != NULL && w->pos + (size_t)n <= w->cap)
        for (int i = 0; i < n; i++)
            w->buf[w->pos + (size_t)i] = (unsigned char)(v >> (8 * i));
    w->pos += (size_t)n;
}

void kt__put_u32(kt__writer *w, uint32_t v) { put(w, v, 4); }
void kt__put_u64(kt__writer *w, uint64_t v) { put(w, v, 8); }
void kt__put_i32(kt__writer *w, int32_t v) { put(w, (uint32_t)v, 4); }
void kt__put_i64(kt__writer *w, int64_t v) { put(w, (uint64_t)v, 8); }

void kt__put_f32(kt__writer *w, float v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    put(w, u, 4);
}

void kt__put_f64(kt__writer *w, double v)
{
    uint64_t u;
    memcpy(&u, &v, 8);
    put(w, u, 8);
}

void kt__put_bytes(kt__writer *w, const void *p, size_t n)
{
    if (w->buf != NULL && w->pos + n <= w->cap && n > 0)
        memcpy(w->buf + w->pos, p, n);
    w->pos += n;
}

static uint64_t get(kt__reader *r, int n)
{
    if (r->bad || r->size - r->pos < (size_t)n) {
        r->bad = 1;
        return 0;
    }
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)r->buf[r->pos + (size_t)i] << (8 * i);
    r->pos += (size_t)n;
    return v;
}

uint32_t kt__get_u32(kt__reader *r) { return (uint32_t)get(r, 4); }
uint64_t kt__get_u64(kt__reader *r) { return get(r, 8); }
int32_t kt__get_i32(kt__reader *r) { return (int32_t)(uint32_t)get(r, 4); }
int64_t kt__get_i64(kt__reader *r) { return (int64_t)get(r, 8); }

float kt__get_f32(kt__reader *r)
{
    uint32_t u = (uint32_t)get(r, 4);
    float v;
    memcpy(&v, &u, 4);
    return v;
}

double kt__get_f64(kt__reader *r)
{
    uint64_t u = get(r, 8);
    double v;
    memcpy(&v, &u, 8);
    return v;
}

const unsigned char *kt__get_bytes(kt__reader *r, size_t n)
{
    if (r->bad || r->size - r->pos < n) {
        r->bad = 1;
        return NULL;
    }
    const unsigned char *p = r->buf + r->pos;
    r->pos += n;
    return p;
}

uint32_t kt__crc32(const void *data, size_t n)
{
    const unsigned char *p = data;
    uint32_t crc = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        crc ^= p[i];
        for (int k = 0; k < 8; k++)
            crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
    }
    return ~crc;
}
