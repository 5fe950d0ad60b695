/* The .ktg text builder and the pieces every architecture shares: norms, nn.Linear
 * projections with their biases and LoRA adapters, SwiGLU MLPs, RoPE attributes. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/hf/hf_internal.h"

void kt__hf_put(kt__hf_buf *b, const char *fmt, ...)
{
    if (b->failed)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = b->cap - b->len;
        int n = vsnprintf(b->p != NULL ? b->p + b->len : NULL, room, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->failed = 1;
            return;
        }
        if ((size_t)n < room) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap ? b->cap * 2 : 4096;
        while (cap - b->len <= (size_t)n)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (p == NULL) {
            b->failed = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
}

void kt__hf_float(char *out, size_t size, double v)
{
    if (v == (double)(long long)v && v > -1e15 && v < 1e15) {
        snprintf(out, size, "%lld", (long long)v); /* 10000, not 1e+04 */
        return;
    }
    for (int digits = 1; digits <= 17; digits++) {
        snprintf(out, size, "%.*g", digits, v);
        if (strtod(out, NULL) == v)
            break;
    }
    /* "1e-06" as "1e-6": the exponent's sign only if negative, no leading zeros */
    char *x = strchr(out, 'e');
    if (x != NULL) {
        char *digits = x + 1;
        if (*digits == '+')
            memmove(digits, digits + 1, strlen(digits));
        else if (*digits == '-')
            digits++;
        while (digits[0] == '0' && digits[1] != '\0')
            memmove(digits, digits + 1, strlen(digits));
    }
}

static void indent(kt__hf_emit *e)
{
    for (int i = 0; i < e->depth; i++)
        kt__hf_put(e->b, "    ");
}

void kt__hf_line(kt__hf_emit *e, const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    indent(e);
    kt__hf_put(e->b, "%s\n", line);
}

const char *kt__hf_segments_arg(const kt__hf_emit *e)
{
    return e->segments || e->context > 0 ? ", segments" : "";
}

void kt__hf_rope_line(kt__hf_emit *e, const char *out, const char *in, const char *attrs)
{
    kt__hf_line(e, "%s = rope(%s%s, %s)", out, in, e->context > 0 ? ", positions" : "", attrs);
}

void kt__hf_attend(kt__hf_emit *e, const char *q, const char *k, const char *v,
                   const char *extra)
{
    if (e->context > 0) {
        kt__hf_line(e, "# the cache, then the new tokens in the last S slots");
        kt__hf_line(e, "keys = concat(past_k{l}, %s, dim = 1)", k);
        kt__hf_line(e, "values = concat(past_v{l}, %s, dim = 1)", v);
        k = "keys";
        v = "values";
    }
    kt__hf_line(e, "o, lse = attention(%s, %s, %s%s, causal = 1%s)", q, k, v,
                kt__hf_segments_arg(e), extra);
}

void kt__hf_open(kt__hf_emit *e, const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    indent(e);
    kt__hf_put(e->b, "%s {\n", line);
    e->depth++;
}

void kt__hf_close(kt__hf_emit *e)
{
    e->depth--;
    indent(e);
    kt__hf_put(e->b, "}\n");
}

const char *kt__hf_param_kw(const kt__hf_emit *e)
{
    return e->lora_rank > 0 ? "param frozen" : "param";
}

void kt__hf_norm(kt__hf_emit *e, const char *out, const char *in, const char *module,
                 const char *dim, double eps)
{
    char f[40];
    kt__hf_float(f, sizeof f, eps);
    kt__hf_line(e, "%s %s.weight: f32[%s] = loaded", kt__hf_param_kw(e), module, dim);
    kt__hf_line(e, "%s = rmsnorm(%s, %s.weight, eps = %s)", out, in, module, f);
}

void kt__hf_linear(kt__hf_emit *e, const char *out, const char *in, const char *module,
                   const char *out_dim, const char *in_dim, int64_t in_size, int bias,
                   unsigned target)
{
    const char *kw = kt__hf_param_kw(e);
    kt__hf_line(e, "%s %s.weight: %s[%s, %s] = loaded", kw, module, e->bf16 ? "bf16" : "f32",
                out_dim, in_dim);
    if (bias)
        kt__hf_line(e, "%s %s.bias: f32[%s] = loaded", kw, module, out_dim);
    int lora = e->lora_rank > 0 && (e->targets & target) != 0;
    if (lora) {
        /* PEFT's init: A kaiming-uniform (a = sqrt 5), i.e. uniform in +-1/sqrt(in); B zero */
        char bound[40], scale[40];
        float lim = (float)(1.0 / sqrt((double)in_size)); /* printed as the f32 it is */
        for (int digits = 1; digits <= 9; digits++) {
            snprintf(bound, sizeof bound, "%.*g", digits, (double)lim);
            if ((float)strtod(bound, NULL) == lim)
                break;
        }
        kt__hf_float(scale, sizeof scale, e->lora_alpha / (double)e->lora_rank);
        kt__hf_line(e, "param %s.lora_A.weight: f32[R, %s] = uniform(-%s, %s)", module, in_dim,
                    bound, bound);
        kt__hf_line(e, "param %s.lora_B.weight: f32[%s, R] = zeros", module, out_dim);
        kt__hf_line(e, "lora = matmul(%s, %s.lora_A.weight, trans_b = 1)", in, module);
        kt__hf_line(e, "lora = matmul(lora, %s.lora_B.weight, trans_b = 1)", module);
        kt__hf_line(e, "lora = scale(lora, alpha = %s)", scale);
    }
    kt__hf_line(e, "%s = matmul(%s, %s.weight, trans_b = 1)", out, in, module);
    if (bias)
        kt__hf_line(e, "%s = add(%s, %s.bias)", out, out, module);
    if (lora)
        kt__hf_line(e, "%s = add(%s, lora)", out, out);
}

void kt__hf_swiglu(kt__hf_emit *e, const char *out, const char *in, const char *module,
                   const char *width, int64_t width_size, int bias)
{
    kt__hf_open(e, "scope %s", module);
    kt__hf_linear(e, "g", in, "gate_proj", width, "H", e->cfg->hidden, bias, KT__HF_T_GATE);
    kt__hf_linear(e, "u", in, "up_proj", width, "H", e->cfg->hidden, bias, KT__HF_T_UP);
    kt__hf_line(e, "%s = swiglu(g, u)", out);
    kt__hf_linear(e, out, out, "down_proj", "H", width, width_size, bias, KT__HF_T_DOWN);
    kt__hf_close(e);
}

void kt__hf_rope_attrs(const kt__hf_emit *e, char *out, size_t size)
{
    const kt__hf_rope *r = &e->cfg->rope;
    char theta[40], f[40];
    kt__hf_float(theta, sizeof theta, r->theta);
    int n = snprintf(out, size, "theta = %s, max_positions = %s", theta,
                     e->context > 0 ? "C" : "S");
    if (r->rotary_dim > 0 && n >= 0 && (size_t)n < size)
        n += snprintf(out + n, size - (size_t)n, ", rotary_dim = %lld",
                      (long long)r->rotary_dim);
    if (e->cfg->rope_interleave && n >= 0 && (size_t)n < size)
        n += snprintf(out + n, size - (size_t)n, ", interleaved = 1%s",
                      e->cfg->rope_deinterleave ? ", deinterleave = 1" : "");
    if (r->type == KT__HF_ROPE_DEFAULT || n < 0 || (size_t)n >= size)
        return;
    kt__hf_float(f, sizeof f, r->factor);
    if (r->type == KT__HF_ROPE_LINEAR) {
        snprintf(out + n, size - (size_t)n, ",\n%*sscaling = linear, factor = %s",
                 4 * (e->depth + 1), "", f);
        return;
    }
    char bf[40], bs[40], m[40], mad[40], af[40];
    kt__hf_float(bf, sizeof bf, r->beta_fast);
    kt__hf_float(bs, sizeof bs, r->beta_slow);
    kt__hf_float(m, sizeof m, r->mscale);
    kt__hf_float(mad, sizeof mad, r->mscale_all_dim);
    kt__hf_float(af, sizeof af, r->attention_factor);
    snprintf(out + n, size - (size_t)n,
             ",\n%*sscaling = yarn, factor = %s, original_max_positions = %lld,"
             "\n%*sbeta_fast = %s, beta_slow = %s, mscale = %s, mscale_all_dim = %s,"
             "\n%*sattention_factor = %s, truncate = %d",
             4 * (e->depth + 1), "", f, (long long)r->original_max_positions,
             4 * (e->depth + 1), "", bf, bs, m, mad, 4 * (e->depth + 1), "", af, r->truncate);
}
