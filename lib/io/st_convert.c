/* Reading a stored float tensor into another float dtype: checkpoints are mostly bf16, and a
 * model wants f32 master weights or a bf16 frozen base.
 *
 * Every conversion rounds once, to nearest even. Widening bf16 or f16 to f32 is exact, so
 * bf16 <-> f16 goes through f32 with one rounding. F64 into f32 is the C conversion (round to
 * nearest in the default rounding mode); F64 into bf16 or f16 first rounds to f32 "to odd"
 * (truncate, then set the last bit when anything was cut off), which keeps the final rounding
 * correct: f32 carries more than two bits beyond either target, so the odd bit stands in for
 * everything dropped and a tie of the target is never manufactured. */
#include <stdlib.h>
#include <string.h>

#include "kt/io.h"
#include "lib/core/error.h"
#include "lib/io/st_internal.h"

#define SHOWN KT__ST_NAME_SHOWN
/* Elements converted per step through the stack buffers. */
#define CHUNK 1024

typedef enum source { SRC_F32, SRC_BF16, SRC_F16, SRC_F64, SRC_OTHER } source;

static source source_of(const kt__st_entry *e)
{
    if (strcmp(e->file_dtype, "F32") == 0)
        return SRC_F32;
    if (strcmp(e->file_dtype, "BF16") == 0)
        return SRC_BF16;
    if (strcmp(e->file_dtype, "F16") == 0)
        return SRC_F16;
    if (strcmp(e->file_dtype, "F64") == 0)
        return SRC_F64;
    return SRC_OTHER;
}

static int float_target(kt_dtype d) { return d == KT_F32 || d == KT_BF16 || d == KT_F16; }

static int same_dtype(const kt__st_entry *e, kt_dtype d) { return e->has_view && e->dtype == d; }

static float f64_to_f32_odd(double d)
{
    float f = (float)d;
    if (d != d || (double)f == d)
        return f; /* NaN, or exact */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    double mag_f = f < 0 ? -(double)f : (double)f, mag_d = d < 0 ? -d : d;
    if (mag_f > mag_d)
        u--; /* one step toward zero: truncation (infinity becomes the largest float) */
    u |= 1u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static kt_status check(const kt_st_file *file, const kt__st_entry *e, const kt_tensor *dst)
{
    char have[96], want[96];
    const char *path = kt__st_entry_path(file, e);
    if (e->ndim != dst->ndim || memcmp(e->shape, dst->shape, (size_t)e->ndim * sizeof e->shape[0]))
        return kt__error(KT_EINVAL, "%s: tensor '%.*s' is %s in the file but the destination is %s",
                         path, SHOWN, e->name, kt__st_describe(e, have, sizeof have),
                         kt_tensor_describe(dst, want, sizeof want));
    if (!same_dtype(e, dst->dtype) && (source_of(e) == SRC_OTHER || !float_target(dst->dtype)))
        return kt__error(KT_EUNSUPPORTED,
                         "%s: tensor '%.*s' is %s in the file, which does not convert to %s "
                         "(libkt converts between the float dtypes F32, BF16, F16 and F64)",
                         path, SHOWN, e->name, e->file_dtype, kt_dtype_name(dst->dtype));
    if (dst->device.type != KT_DEVICE_CPU || !kt_tensor_is_contiguous(dst))
        return kt__error(KT_EINVAL,
                         "%s: tensor '%.*s': the destination must be a contiguous CPU tensor",
                         path, SHOWN, e->name);
    return KT_OK;
}

kt_status kt_st_check_convert(const kt_st_file *file, const char *name, const kt_tensor *dst)
{
    if (file == NULL || name == NULL || dst == NULL)
        return kt__error(KT_EINVAL, "kt_st_check_convert: NULL argument");
    const kt__st_entry *e = kt__st_find_entry(file, name);
    if (e == NULL)
        return kt__error(KT_EINVAL, "%s: no tensor named '%.*s'", file->label, SHOWN, name);
    return check(file, e, dst);
}

/* n elements of the stored tensor from src into f32 (for a bf16 or f16 target from F64:
 * rounded to odd, see above). */
static void widen(source from, int odd, const unsigned char *src, size_t n, float *out)
{
    uint16_t h[CHUNK];
    double d[CHUNK];
    switch (from) {
    case SRC_F32:
        memcpy(out, src, n * sizeof *out);
        break;
    case SRC_BF16:
        memcpy(h, src, n * sizeof *h);
        kt_bf16_to_f32(out, h, n);
        break;
    case SRC_F16:
        memcpy(h, src, n * sizeof *h);
        kt_f16_to_f32(out, h, n);
        break;
    default: /* SRC_F64; check() let no other through */
        memcpy(d, src, n * sizeof *d);
        for (size_t i = 0; i < n; i++)
            out[i] = odd ? f64_to_f32_odd(d[i]) : (float)d[i];
        break;
    }
}

kt_status kt_st_read_convert(const kt_st_file *file, const char *name, kt_tensor *dst)
{
    if (file == NULL || name == NULL || dst == NULL)
        return kt__error(KT_EINVAL, "kt_st_read_convert: NULL argument");
    const kt__st_entry *e = kt__st_find_entry(file, name);
    if (e == NULL)
        return kt__error(KT_EINVAL, "%s: no tensor named '%.*s'", file->label, SHOWN, name);
    if (same_dtype(e, dst->dtype))
        return kt_st_read(file, name, dst);
    KT__TRY(check(file, e, dst));
    size_t n = (size_t)kt_tensor_numel(dst), in_size = e->bits / 8;
    if (n > 0 && dst->data == NULL)
        return kt__error(KT_EINVAL, "%s: tensor '%.*s': the destination has no data",
                         kt__st_entry_path(file, e), SHOWN, name);
    const source from = source_of(e);
    const int odd = dst->dtype != KT_F32;
    const unsigned char *src = kt__st_entry_data(file, e);
    unsigned char *out = dst->data;
    float wide[CHUNK];
    uint16_t narrow[CHUNK];
    for (size_t at = 0; at < n; at += CHUNK) {
        size_t k = n - at < CHUNK ? n - at : CHUNK;
        widen(from, odd, src + at * in_size, k, wide);
        if (dst->dtype == KT_F32) {
            memcpy(out + at * sizeof(float), wide, k * sizeof(float));
            continue;
        }
        if (dst->dtype == KT_BF16)
            kt_f32_to_bf16(narrow, wide, k);
        else
            kt_f32_to_f16(narrow, wide, k);
        memcpy(out + at * sizeof(uint16_t), narrow, k * sizeof(uint16_t));
    }
    kt__st_release(file, e);
    return KT_OK;
}
