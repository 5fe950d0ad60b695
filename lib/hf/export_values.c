/* Values between dtypes for the export, and a safetensors header for files streamed tensor by
 * tensor (a shard of a large checkpoint is never held whole in memory). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/hf/export_internal.h"

double kt__elem_get(const kt_tensor *view, size_t i)
{
    const unsigned char *p = (const unsigned char *)view->data;
    switch (view->dtype) {
    case KT_F32: {
        float x;
        memcpy(&x, p + 4 * i, 4);
        return x;
    }
    case KT_BF16: {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        return kt_bf16_to_f32_1(h);
    }
    case KT_F16: {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        return kt_f16_to_f32_1(h);
    }
    default:
        return 0.0; /* callers check the dtype first */
    }
}

/* x rounded to float toward zero, with the last bit set when inexact ("round to odd"): then
 * rounding that float to bf16 or f16 (8 or 11 bits, at least 2 fewer than float's 24) gives
 * exactly the nearest-even rounding of x itself, with no double-rounding error. */
static float round_to_odd_f32(double x)
{
    float f = (float)x;
    if (isnan(x) || isinf(f) || (double)f == x)
        return f;
    if (fabs((double)f) > fabs(x))
        f = nextafterf(f, 0.0f);
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u |= 1u;
    memcpy(&f, &u, sizeof f);
    return f;
}

void kt__elem_put(double x, kt_dtype dtype, void *dst)
{
    if (dtype == KT_F32) {
        float f = (float)x;
        memcpy(dst, &f, 4);
    } else if (dtype == KT_BF16) {
        uint16_t h = kt_f32_to_bf16_1(round_to_odd_f32(x));
        memcpy(dst, &h, 2);
    } else if (dtype == KT_F16) {
        uint16_t h = kt_f32_to_f16_1(round_to_odd_f32(x));
        memcpy(dst, &h, 2);
    }
}

kt_status kt__adapter_values(const kt__adapter *a, double **values_out)
{
    size_t na = (size_t)kt_tensor_numel(&a->a), nb = (size_t)kt_tensor_numel(&a->b);
    double *v = malloc((na + nb) * sizeof *v);
    if (v == NULL)
        return kt__error(KT_ENOMEM, "%s: out of memory for its adapter", a->module);
    for (size_t i = 0; i < na; i++)
        v[i] = kt__elem_get(&a->a, i);
    for (size_t i = 0; i < nb; i++)
        v[na + i] = kt__elem_get(&a->b, i);
    *values_out = v;
    return KT_OK;
}

/* ---- the header ----------------------------------------------------------------------------- */

typedef struct text {
    char *s;
    size_t len, cap;
    int failed;
} text;

static void put(text *t, const char *s, size_t n)
{
    if (t->failed)
        return;
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 4096;
        while (t->len + n + 1 > cap)
            cap *= 2;
        char *grown = realloc(t->s, cap);
        if (grown == NULL) {
            t->failed = 1;
            return;
        }
        t->s = grown;
        t->cap = cap;
    }
    memcpy(t->s + t->len, s, n);
    t->len += n;
    t->s[t->len] = '\0';
}

static void puts_(text *t, const char *s) { put(t, s, strlen(s)); }

static void put_string(text *t, const char *s)
{
    puts_(t, "\"");
    for (; *s; s++) {
        char esc[8];
        if (*s == '"' || *s == '\\') {
            esc[0] = '\\', esc[1] = *s, esc[2] = '\0';
            puts_(t, esc);
        } else if ((unsigned char)*s < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", (unsigned)(unsigned char)*s);
            puts_(t, esc);
        } else {
            put(t, s, 1);
        }
    }
    puts_(t, "\"");
}

static const char *st_dtype(kt_dtype d)
{
    switch (d) {
    case KT_F32: return "F32";
    case KT_BF16: return "BF16";
    case KT_F16: return "F16";
    case KT_I32: return "I32";
    case KT_I64: return "I64";
    default: return NULL;
    }
}

kt_status kt__st_write_header(kt_out_file *f, const kt__st_header_item *items, size_t n,
                              const char *path)
{
    text t = {0};
    uint64_t offset = 0;
    char num[64];
    puts_(&t, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (size_t i = 0; i < n; i++) {
        const char *dt = st_dtype(items[i].dtype);
        if (dt == NULL) {
            free(t.s);
            return kt__error(KT_EINVAL, "%s: tensor '%s': dtype cannot be written", path,
                             items[i].name);
        }
        uint64_t bytes = kt_dtype_size(items[i].dtype);
        puts_(&t, ",");
        put_string(&t, items[i].name);
        puts_(&t, ":{\"dtype\":\"");
        puts_(&t, dt);
        puts_(&t, "\",\"shape\":[");
        for (int d = 0; d < items[i].ndim; d++) {
            snprintf(num, sizeof num, "%s%lld", d ? "," : "", (long long)items[i].shape[d]);
            puts_(&t, num);
            bytes *= (uint64_t)items[i].shape[d];
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)offset,
                 (unsigned long long)(offset + bytes));
        puts_(&t, num);
        offset += bytes;
    }
    puts_(&t, "}");
    while (!t.failed && (8 + t.len) % 8 != 0)
        puts_(&t, " ");
    if (t.failed) {
        free(t.s);
        return kt__error(KT_ENOMEM, "%s: out of memory for the header", path);
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)((uint64_t)t.len >> (8 * i));
    kt_status st = kt_out_write(f, len8, 8);
    if (st == KT_OK)
        st = kt_out_write(f, t.s, t.len);
    free(t.s);
    return st;
}
