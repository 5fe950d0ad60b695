/* The expert weights and the trainable parameters: copies in, views out, and safetensors under
 * the layer's checkpoint names (kt_moe_tensor_name) or Hugging Face's under a prefix. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/moe/moe_internal.h"
#include "lib/moe/trainable.h"

static const char *const proj_names[3] = {"gate_proj", "up_proj", "down_proj"};

static kt_status check_index(const kt_moe *m, const char *fn, int64_t e, kt_moe_proj proj)
{
    if (e < 0 || e >= m->dim.E)
        return kt__error(KT_ERANGE, "moe '%s': %s: expert %lld out of range [0, %lld)", m->name, fn,
                         (long long)e, (long long)m->dim.E);
    if ((int)proj < 0 || (int)proj > 2)
        return kt__error(KT_EINVAL, "moe '%s': %s: unknown projection %d", m->name, fn, (int)proj);
    return KT_OK;
}

/* The stored weight of (e, proj) as a tensor: [out, in]. */
static void weight_view(const kt_moe *m, int64_t e, int proj, kt_tensor *t)
{
    int64_t shape[2] = {kt__moe_proj_out(m, proj), kt__moe_proj_in(m, proj)};
    kt_tensor_init(t, kt__moe_weight_ptr(m, e, proj), m->cfg.weight_dtype, 2, shape);
}

/* Whether t fits (e, proj)'s weight as kt_moe_set_weight / kt_moe_get_weight take it: the
 * weight dtype, or f32 or bf16 for a quantized layer. */
static kt_status check_weight_tensor(const kt_moe *m, const char *fn, int64_t e, int proj,
                                     const kt_tensor *t)
{
    kt_tensor want_t;
    weight_view(m, e, proj, &want_t);
    const kt_dtype d1 = m->dim.quant ? KT_F32 : want_t.dtype, d2 = m->dim.quant ? KT_BF16 : d1;
    char want[64], got[64], why[256];
    if (t->data == NULL)
        return kt__error(KT_EINVAL, "moe '%s': %s expert %lld %s: the tensor has no data", m->name,
                         fn, (long long)e, proj_names[proj]);
    if (!kt__moe_tensor_fits(t, d1, d2, want_t.ndim, want_t.shape, why, sizeof why))
        return kt__error(KT_EINVAL, "moe '%s': %s expert %lld %s: expected a contiguous CPU %s, got %s: %s",
                         m->name, fn, (long long)e, proj_names[proj],
                         m->dim.quant ? kt__moe_tensor_wanted(d1, d2, want_t.ndim, want_t.shape,
                                                              want, sizeof want)
                                      : kt_tensor_describe(&want_t, want, sizeof want),
                         kt_tensor_describe(t, got, sizeof got), why);
    return KT_OK;
}

kt_status kt_moe_set_weight(kt_moe *moe, int64_t expert, kt_moe_proj proj, const kt_tensor *w)
{
    if (moe == NULL || w == NULL)
        return kt__error(KT_EINVAL, "kt_moe_set_weight: NULL argument");
    KT__TRY(check_index(moe, "set_weight", expert, proj));
    KT__TRY(check_weight_tensor(moe, "set_weight", expert, proj, w));
    if (moe->dim.quant) {
        kt_status st = kt__q_quantize(&moe->store.qmat[expert * 3 + proj], w->data, w->dtype);
        if (st != KT_OK)
            return kt__error_context(st, "moe '%s': set_weight expert %lld %s", moe->name,
                                     (long long)expert, proj_names[proj]);
        return KT_OK;
    }
    memcpy(kt__moe_weight_ptr(moe, expert, proj), w->data, kt_tensor_nbytes(w));
    return KT_OK;
}

kt_status kt_moe_weight(kt_moe *moe, int64_t expert, kt_moe_proj proj, kt_tensor *view_out)
{
    if (moe == NULL || view_out == NULL)
        return kt__error(KT_EINVAL, "kt_moe_weight: NULL argument");
    KT__TRY(check_index(moe, "weight", expert, proj));
    if (moe->dim.quant)
        return kt__error(KT_ESTATE,
                         "moe '%s': weight: the experts are stored quantized (%s), not as a "
                         "tensor to view: read them with kt_moe_get_weight, set them with "
                         "kt_moe_set_weight",
                         moe->name, kt_moe_quant_name(moe->cfg.quant));
    weight_view(moe, expert, proj, view_out);
    return KT_OK;
}

/* Value i of a [rows, cols] weight block as stored (f32 or bf16). */
static float stored_at(const kt_moe *m, const void *w, int64_t i)
{
    return m->dim.bf16 ? kt_bf16_to_f32_1(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

kt_status kt_moe_get_weight(const kt_moe *moe, int64_t expert, kt_moe_proj proj, kt_tensor *out)
{
    if (moe == NULL || out == NULL)
        return kt__error(KT_EINVAL, "kt_moe_get_weight: NULL argument");
    KT__TRY(check_index(moe, "get_weight", expert, proj));
    const int64_t rows = kt__moe_proj_out(moe, proj), cols = kt__moe_proj_in(moe, proj);
    const int64_t shape[2] = {rows, cols};
    char want[64], got[64], why[256];
    if (out->data == NULL ||
        !kt__moe_tensor_fits(out, KT_F32, KT_BF16, 2, shape, why, sizeof why))
        return kt__error(KT_EINVAL,
                         "moe '%s': get_weight expert %lld %s: expected a contiguous CPU %s, got "
                         "%s: %s",
                         moe->name, (long long)expert, proj_names[proj],
                         kt__moe_tensor_wanted(KT_F32, KT_BF16, 2, shape, want, sizeof want),
                         kt_tensor_describe(out, got, sizeof got),
                         out->data == NULL ? "it has no data" : why);
    const void *w = kt__moe_weight_ptr(moe, expert, proj);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            const float v = moe->dim.quant ? kt__q_value(w, r, c) : stored_at(moe, w, r * cols + c);
            if (out->dtype == KT_F32)
                ((float *)out->data)[r * cols + c] = v;
            else
                ((uint16_t *)out->data)[r * cols + c] = kt_f32_to_bf16_1(v);
        }
    return KT_OK;
}

static void lora_view(const kt_moe *m, float *base, int64_t e, int proj, int which_b, kt_tensor *t)
{
    int64_t shape[2];
    if (which_b) {
        shape[0] = kt__moe_proj_out(m, proj);
        shape[1] = m->dim.R;
    } else {
        shape[0] = m->dim.R;
        shape[1] = kt__moe_proj_in(m, proj);
    }
    kt_tensor_init(t, kt__moe_lora_ptr(m, base, e, proj, which_b), KT_F32, 2, shape);
}

static kt_status lora_common(kt_moe *m, const char *fn, int64_t e, kt_moe_proj proj, int which_b,
                             float *base, kt_tensor *view_out)
{
    if (m == NULL || view_out == NULL)
        return kt__error(KT_EINVAL, "kt_moe_%s: NULL argument", fn);
    if (m->cfg.mode != KT_MOE_LORA)
        return kt__error(KT_ESTATE, "moe '%s': %s: the layer is not in LoRA mode", m->name, fn);
    KT__TRY(check_index(m, fn, e, proj));
    lora_view(m, base, e, proj, which_b != 0, view_out);
    return KT_OK;
}

kt_status kt_moe_lora(kt_moe *moe, int64_t expert, kt_moe_proj proj, int which_b,
                      kt_tensor *view_out)
{
    return lora_common(moe, "lora", expert, proj, which_b, moe ? moe->train.lora : NULL, view_out);
}

kt_status kt_moe_lora_grad(kt_moe *moe, int64_t expert, kt_moe_proj proj, int which_b,
                           kt_tensor *view_out)
{
    return lora_common(moe, "lora_grad", expert, proj, which_b, moe ? moe->train.lora_grad : NULL,
                       view_out);
}

kt_status kt_moe_weight_grad(kt_moe *moe, int64_t expert, kt_moe_proj proj, kt_tensor *view_out)
{
    if (moe == NULL || view_out == NULL)
        return kt__error(KT_EINVAL, "kt_moe_weight_grad: NULL argument");
    if (moe->cfg.mode != KT_MOE_FULL)
        return kt__error(KT_ESTATE, "moe '%s': weight_grad: the layer is not in full mode",
                         moe->name);
    KT__TRY(check_index(moe, "weight_grad", expert, proj));
    int64_t shape[2] = {kt__moe_proj_out(moe, proj), kt__moe_proj_in(moe, proj)};
    return kt_tensor_init(view_out,
                          moe->train.weight_grad + (expert * 3 + proj) * moe->dim.H * moe->dim.I,
                          KT_F32, 2, shape);
}

/* ---- safetensors --------------------------------------------------------------------------- */

#define NAME_MAX_LEN KT__MOE_NAME_BYTES

static const char *const kind_suffix[3] = {"weight", "lora_A.weight", "lora_B.weight"};

kt_status kt__moe_names_prefix(kt_moe_names names, int layer, char *buf, size_t size)
{
    int n;
    switch (names) {
    case KT_MOE_NAMES_MOE:
        n = snprintf(buf, size, "moe.%d.experts.", layer);
        break;
    case KT_MOE_NAMES_HF:
        n = snprintf(buf, size, "model.layers.%d.mlp.experts.", layer);
        break;
    case KT_MOE_NAMES_MIXTRAL:
        n = snprintf(buf, size, "model.layers.%d.block_sparse_moe.experts.", layer);
        break;
    default:
        return kt__error(KT_EINVAL, "unknown MoE tensor names %d (kt_moe_names)", (int)names);
    }
    if (n < 0 || (size_t)n >= size)
        return kt__error(KT_ERANGE, "MoE tensor name prefix: %zu bytes are too few", size);
    return KT_OK;
}

kt_status kt_moe_tensor_name(kt_moe_names names, int layer, int64_t expert, kt_moe_proj proj,
                             const char *suffix, char *buf, size_t size)
{
    static const char *const mixtral_proj[3] = {"w1", "w3", "w2"}; /* gate, up, down */
    if (suffix == NULL || buf == NULL)
        return kt__error(KT_EINVAL, "kt_moe_tensor_name: NULL argument");
    if ((int)proj < 0 || (int)proj > 2)
        return kt__error(KT_EINVAL, "kt_moe_tensor_name: unknown projection %d", (int)proj);
    if (layer < 0 || expert < 0)
        return kt__error(KT_EINVAL, "kt_moe_tensor_name: layer %d, expert %lld: negative", layer,
                         (long long)expert);
    int known = 0;
    for (int k = 0; k < 3; k++)
        known |= strcmp(suffix, kind_suffix[k]) == 0;
    if (!known)
        return kt__error(KT_EINVAL, "kt_moe_tensor_name: suffix '%.64s' is none of weight, "
                         "lora_A.weight, lora_B.weight", suffix);
    char prefix[128], name[NAME_MAX_LEN];
    kt_status st = kt__moe_names_prefix(names, layer, prefix, sizeof prefix);
    if (st != KT_OK)
        return kt__error_context(st, "kt_moe_tensor_name");
    const char *pn = names == KT_MOE_NAMES_MIXTRAL ? mixtral_proj[proj] : proj_names[proj];
    int n = snprintf(name, sizeof name, "%s%lld.%s.%s", prefix, (long long)expert, pn, suffix);
    if (n < 0 || (size_t)n >= size)
        return kt__error(KT_ERANGE, "kt_moe_tensor_name: '%s' needs %d bytes, the buffer has %zu",
                         name, n + 1, size);
    memcpy(buf, name, (size_t)n + 1);
    return KT_OK;
}

/* The layer's own names, or Hugging Face's projection names under a prefix. */
kt__moe_naming kt__moe_own_naming(const kt_moe *moe)
{
    return (kt__moe_naming){.prefix = NULL, .names = moe->cfg.names, .layer = moe->cfg.layer};
}

static kt__moe_naming prefix_or_own(const kt_moe *moe, const char *prefix)
{
    kt__moe_naming nm = kt__moe_own_naming(moe);
    nm.prefix = prefix;
    return nm;
}

/* The kinds of a layer's tensors in files: the float weight, LoRA's A and B, and a quantized
 * weight's codes (its value bytes as i32, 1-D) and scales (bf16 [rows, groups]): exact, so that
 * a checkpoint of a quantized layer reads back to the same store. */
enum { KIND_WEIGHT = 0, KIND_LORA_A = 1, KIND_LORA_B = 2, KIND_QCODES = 3, KIND_QSCALES = 4 };

/* kind: as above; the codes and scales are named after the weight ("...weight.qcodes") */
static kt_status tensor_name(const kt_moe *m, char *buf, const kt__moe_naming *nm, int64_t local,
                             int proj, int kind)
{
    if (kind >= KIND_QCODES) {
        KT__TRY(tensor_name(m, buf, nm, local, proj, KIND_WEIGHT));
        const size_t len = strlen(buf);
        const char *suffix = kind == KIND_QCODES ? ".qcodes" : ".qscales";
        if (len + strlen(suffix) >= NAME_MAX_LEN)
            return kt__error(KT_EINVAL, "moe '%s': tensor name too long", m->name);
        memcpy(buf + len, suffix, strlen(suffix) + 1);
        return KT_OK;
    }
    const int64_t e = kt__moe_global_id(m, local); /* files name the model's experts */
    if (nm->prefix == NULL) {
        kt_status st = kt_moe_tensor_name(nm->names, nm->layer, e, (kt_moe_proj)proj,
                                          kind_suffix[kind], buf, NAME_MAX_LEN);
        return st == KT_OK ? KT_OK : kt__error_context(st, "moe '%s'", m->name);
    }
    int n = snprintf(buf, NAME_MAX_LEN, "%sexperts.%lld.%s.%s", nm->prefix, (long long)e,
                     proj_names[proj], kind_suffix[kind]);
    if (n < 0 || n >= NAME_MAX_LEN)
        return kt__error(KT_EINVAL, "moe '%s': tensor name prefix too long", m->name);
    return KT_OK;
}

static void param_view(const kt_moe *m, int64_t e, int proj, int kind, kt_tensor *t)
{
    if (kind >= KIND_QCODES) {
        kt__qmat *q = &m->store.qmat[e * 3 + proj];
        const int64_t groups = q->cols / q->group;
        const int64_t codes[1] = {(int64_t)(kt__q_value_bytes(q->fmt, q->rows, q->cols) + 3) / 4};
        const int64_t scales[2] = {q->rows, groups};
        /* the codes' last i32 may reach into the block's padding (quant_store.c aligns) */
        if (kind == KIND_QCODES)
            kt_tensor_init(t, q->q, KT_I32, 1, codes);
        else
            kt_tensor_init(t, q->scale, KT_BF16, 2, scales);
    } else if (kind == KIND_WEIGHT)
        weight_view(m, e, proj, t);
    else
        lora_view(m, m->train.lora, e, proj, kind == 2, t);
}

/* A NaN or Inf scale would make every weight of its group one: refused, naming it. */
static kt_status check_finite_scales(const kt_tensor *t, const char *name)
{
    for (int64_t i = 0; i < kt_tensor_numel(t); i++) {
        const float v = kt_bf16_to_f32_1(((const uint16_t *)t->data)[i]);
        if (!isfinite(v))
            return kt__error(KT_EINVAL, "tensor '%s': scale [%lld, %lld] is %g (not finite)", name,
                             (long long)(i / t->shape[1]), (long long)(i % t->shape[1]),
                             (double)v);
    }
    return KT_OK;
}

/* Whether the file has any of the tensors of `kind` (0 base weights, 1-2 adapters). */
static kt_status file_has_kind(const kt_moe *moe, const kt_st_file *file, const kt__moe_naming *nm,
                               int kind, int *has)
{
    char name[NAME_MAX_LEN];
    *has = 0;
    for (int64_t e = 0; e < moe->dim.E && !*has; e++)
        for (int p = 0; p < 3 && !*has; p++) {
            KT__TRY(tensor_name(moe, name, nm, e, p, kind));
            size_t at;
            *has = kt_st_lookup(file, name, &at) == KT_OK;
            kt_clear_error();
        }
    return KT_OK;
}

/* Pass 0 checks every tensor the layer would read (name, dtype, shape); pass 1 copies.
 * convert: stored float dtypes other than the layer's are converted (else refused). A quantized
 * layer reads each base weight as f32 into `staging` and quantizes it (pass 1 finds a NaN or
 * Inf, after the experts before it are in). */
static kt_status load_passes(kt_moe *moe, const kt_st_file *file, const kt__moe_naming *nm,
                             int last_pass, int convert, float *staging)
{
    if (moe->async.busy)
        return kt__error(KT_ESTATE, "moe '%s': load while a forward is in flight", moe->name);
    char name[NAME_MAX_LEN];
    /* LoRA adapters are loaded when the file has them, all or none: any one of them there
     * makes every one required (so a file missing some is an error naming the first, not a
     * silent load of the base weights alone). A quantized layer's base weights likewise (its
     * own checkpoints hold the adapters only). */
    int with_lora = 0, with_codes = 0, with_weights = 1;
    if (moe->cfg.mode == KT_MOE_LORA)
        for (int kind = KIND_LORA_A; kind <= KIND_LORA_B && !with_lora; kind++)
            KT__TRY(file_has_kind(moe, file, nm, kind, &with_lora));
    if (moe->dim.quant) { /* its own codes and scales, else float weights to quantize */
        KT__TRY(file_has_kind(moe, file, nm, KIND_QCODES, &with_codes));
        if (with_codes)
            with_weights = 0;
        else
            KT__TRY(file_has_kind(moe, file, nm, KIND_WEIGHT, &with_weights));
    }
    int kinds[4], n_kinds = 0;
    if (with_weights)
        kinds[n_kinds++] = KIND_WEIGHT;
    if (with_codes)
        kinds[n_kinds++] = KIND_QCODES, kinds[n_kinds++] = KIND_QSCALES;
    if (with_lora)
        kinds[n_kinds++] = KIND_LORA_A, kinds[n_kinds++] = KIND_LORA_B;
    for (int pass = 0; pass <= last_pass; pass++)
        for (int64_t e = 0; e < moe->dim.E; e++)
            for (int p = 0; p < 3; p++)
                for (int ki = 0; ki < n_kinds; ki++) {
                    const int kind = kinds[ki];
                    kt_tensor dst;
                    KT__TRY(tensor_name(moe, name, nm, e, p, kind));
                    param_view(moe, e, p, kind, &dst);
                    if (kind == KIND_WEIGHT && moe->dim.quant)
                        dst.dtype = KT_F32, dst.data = staging;
                    /* scales are checked before anything is copied: read into staging first */
                    const int check_scales = kind == KIND_QSCALES && pass == 0;
                    if (check_scales)
                        dst.data = staging;
                    size_t at;
                    kt_st_info info;
                    kt_status st = kt_st_lookup(file, name, &at);
                    if (st == KT_OK)
                        st = kt_st_entry_info(file, at, &info);
                    if (st == KT_OK && (info.ndim != dst.ndim ||
                                        memcmp(info.shape, dst.shape,
                                               (size_t)dst.ndim * sizeof dst.shape[0]) != 0 ||
                                        (!convert && info.dtype != dst.dtype &&
                                         !(moe->dim.quant && kind == 0 &&
                                           (info.dtype == KT_F32 || info.dtype == KT_BF16))))) {
                        char got[96], want[96];
                        kt_tensor t;
                        if (info.dtype == KT_DTYPE_COUNT ||
                            kt_tensor_init(&t, NULL, info.dtype, info.ndim, info.shape) != KT_OK)
                            snprintf(got, sizeof got, "%s", info.file_dtype);
                        else
                            kt_tensor_describe(&t, got, sizeof got);
                        st = kt__error(KT_EINVAL, "tensor '%s' is %s, the layer needs %s", name,
                                       got, kt_tensor_describe(&dst, want, sizeof want));
                    }
                    /* with convert: float dtypes convert (F32/BF16/F16/F64, one rounding); codes
                     * and scales only as they are */
                    if (st == KT_OK && kind >= KIND_QCODES && info.dtype != dst.dtype)
                        st = kt__error(KT_EINVAL, "tensor '%s' is %s, the layer needs %s", name,
                                       kt_dtype_name(info.dtype), kt_dtype_name(dst.dtype));
                    if (st == KT_OK)
                        st = pass == 1 || check_scales ? kt_st_read_convert(file, name, &dst)
                                                       : kt_st_check_convert(file, name, &dst);
                    if (st == KT_OK && check_scales)
                        st = check_finite_scales(&dst, name);
                    if (st == KT_OK && pass == 1 && kind == KIND_WEIGHT && moe->dim.quant)
                        st = kt__q_quantize(&moe->store.qmat[e * 3 + p], staging, KT_F32);
                    if (st != KT_OK)
                        return kt__error_context(st, "moe '%s': load '%s'", moe->name, name);
                }
    return KT_OK;
}

/* load_passes with the staging a quantized layer reads its weights (and, to check them, its
 * scales) through (I/O: it may allocate). */
static kt_status load_all(kt_moe *moe, const kt_st_file *file, const kt__moe_naming *nm,
                          int last_pass, int convert)
{
    float *staging = NULL;
    if (moe->dim.quant &&
        (staging = malloc((size_t)(moe->dim.H * moe->dim.I) * sizeof(float))) == NULL)
        return kt__error(KT_ENOMEM, "moe '%s': load: out of memory", moe->name);
    kt_status st = load_passes(moe, file, nm, last_pass, convert, staging);
    free(staging);
    return st;
}

kt_status kt_moe_load(kt_moe *moe, const kt_st_file *file, const char *prefix)
{
    if (moe == NULL || file == NULL)
        return kt__error(KT_EINVAL, "kt_moe_load: NULL argument");
    /* everything checked before anything is copied: a bad file leaves the weights */
    kt__moe_naming nm = prefix_or_own(moe, prefix);
    return load_all(moe, file, &nm, 1, 0);
}

kt_status kt__moe_load_named(kt_moe *moe, const kt_st_file *file, const kt__moe_naming *naming,
                             int dry_run)
{
    return load_all(moe, file, naming, dry_run ? 0 : 1, 1);
}

int kt__moe_names_tensor(const kt_moe *moe, const kt__moe_naming *naming, const char *name)
{
    char prefix[NAME_MAX_LEN], want[NAME_MAX_LEN];
    if (naming->prefix != NULL) {
        if (snprintf(prefix, sizeof prefix, "%sexperts.", naming->prefix) >= (int)sizeof prefix)
            return 0;
    } else if (kt__moe_names_prefix(naming->names, naming->layer, prefix, sizeof prefix) !=
               KT_OK) {
        kt_clear_error();
        return 0;
    }
    const size_t len = strlen(prefix);
    if (strncmp(name, prefix, len) != 0 || name[len] < '0' || name[len] > '9')
        return 0;
    char *end = NULL;
    const long long g = strtoll(name + len, &end, 10);
    if (g < 0 || *end != '.')
        return 0;
    int64_t e = moe->expert_ids ? -1 : g;
    for (int64_t i = 0; moe->expert_ids != NULL && i < moe->dim.E; i++)
        if (moe->expert_ids[i] == g)
            e = i;
    if (e < 0 || e >= moe->dim.E)
        return 0;
    for (int p = 0; p < 3; p++)
        for (int kind = KIND_WEIGHT; kind <= KIND_QSCALES; kind++) {
            const int lora = kind == KIND_LORA_A || kind == KIND_LORA_B;
            if ((lora && moe->cfg.mode != KT_MOE_LORA) || (kind >= KIND_QCODES && !moe->dim.quant))
                continue;
            if (tensor_name(moe, want, naming, e, p, kind) == KT_OK && strcmp(name, want) == 0)
                return 1;
        }
    kt_clear_error();
    return 0;
}

/* The kinds a layer saves, in order: its weights (a quantized layer's codes and scales), and
 * LoRA's A and B. */
static int saved_kinds(const kt_moe *moe, int *kinds)
{
    int n = 0;
    if (moe->dim.quant)
        kinds[n++] = KIND_QCODES, kinds[n++] = KIND_QSCALES;
    else
        kinds[n++] = KIND_WEIGHT;
    if (moe->cfg.mode == KT_MOE_LORA)
        kinds[n++] = KIND_LORA_A, kinds[n++] = KIND_LORA_B;
    return n;
}

size_t kt__moe_st_count(const kt_moe *moe)
{
    int kinds[4];
    return (size_t)(moe->dim.E * 3 * saved_kinds(moe, kinds));
}

kt_status kt__moe_st_items(const kt_moe *moe, const kt__moe_naming *naming, kt_st_item *items,
                           char *names)
{
    int kinds[4];
    const int n = saved_kinds(moe, kinds);
    size_t i = 0;
    for (int64_t e = 0; e < moe->dim.E; e++)
        for (int p = 0; p < 3; p++)
            for (int k = 0; k < n; k++, i++) {
                char *name = names + i * KT__MOE_NAME_BYTES;
                KT__TRY(tensor_name(moe, name, naming, e, p, kinds[k]));
                items[i].name = name;
                param_view(moe, e, p, kinds[k], &items[i].tensor);
            }
    return KT_OK;
}

kt_status kt_moe_save_layers(const kt_moe *const *layers, const char *const *prefixes, int n,
                             const char *path)
{
    if (layers == NULL || path == NULL || n < 0)
        return kt__error(KT_EINVAL, "kt_moe_save_layers: NULL argument or negative count");
    size_t total = 0;
    for (int l = 0; l < n; l++) {
        if (layers[l] == NULL)
            return kt__error(KT_EINVAL, "kt_moe_save_layers: layer %d is NULL", l);
        total += kt__moe_st_count(layers[l]);
    }
    /* Saving is I/O, not a training step: it may allocate its item list. */
    kt_st_item *items = calloc(total + 1, sizeof *items);
    char *names = calloc(total + 1, KT__MOE_NAME_BYTES);
    kt_status st = KT_OK;
    if (items == NULL || names == NULL) {
        st = kt__error(KT_ENOMEM, "kt_moe_save_layers: out of memory");
        goto done;
    }
    size_t i = 0;
    for (int l = 0; l < n && st == KT_OK; l++) {
        kt__moe_naming nm = prefix_or_own(layers[l], prefixes != NULL ? prefixes[l] : NULL);
        st = kt__moe_st_items(layers[l], &nm, items + i, names + i * KT__MOE_NAME_BYTES);
        i += kt__moe_st_count(layers[l]);
    }
    if (st == KT_OK) /* two layers under the same names: kt_st_save refuses the duplicate */
        st = kt_st_save(path, items, total, NULL);
    if (st != KT_OK) {
        if (n == 1)
            kt__error_context(st, "moe '%s': save", layers[0]->name);
        else
            kt__error_context(st, "kt_moe_save_layers (%d layers)", n);
    }
done:
    free(names);
    free(items);
    return st;
}

kt_status kt_moe_save(const kt_moe *moe, const char *path, const char *prefix)
{
    if (moe == NULL || path == NULL)
        return kt__error(KT_EINVAL, "kt_moe_save: NULL argument");
    return kt_moe_save_layers(&moe, &prefix, 1, path);
}
