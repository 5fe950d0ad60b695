/* rope's frequencies and angles: inv_freq_j = theta^(-2j/r) for the r rotated elements,
 * divided by factor (linear scaling), or YaRN's blend of the two; and the cos/sin of a
 * position, which a session's table and a direct call both take from kt__rope_angles.
 *
 * Everything is computed in float64 and rounded once to f32. transformers forms
 * position * inv_freq in f32, whose error grows with the position (about pos * 2^-24 rad,
 * 6e-3 rad at 10^5); in float64 each table entry is the exact rotation rounded once, at any
 * position, and the same on every libm whose double cos and sin are correctly rounded.
 * It costs nothing in a session: the table is built once, when it is bound. */
#include <math.h>
#include <string.h>

#include "lib/ops/rope.h"

#define ROPE_PI 3.14159265358979323846

_Static_assert(sizeof(kt__rope_key) == 2 * 8 + 3 * 4 + 7 * 4, "kt__rope_key has padding, which "
               "its bytewise comparison would read");

kt__rope_key kt__rope_key_of(const kt_op_attrs *a, int64_t d)
{
    kt__rope_key k;
    memset(&k, 0, sizeof k); /* compared bytewise: no stray padding */
    k.max_positions = a->rope_max_positions;
    k.rotary_dim = a->rope_rotary_dim > 0 ? a->rope_rotary_dim : (int32_t)d;
    k.scaling = (int32_t)a->rope_scaling;
    k.theta = a->rope_theta;
    k.attention_factor = a->rope_attention_factor;
    if (a->rope_scaling != KT_ROPE_SCALING_NONE)
        k.factor = a->rope_factor;
    if (a->rope_scaling == KT_ROPE_SCALING_YARN) {
        k.original_max_positions = a->rope_original_max_positions;
        k.truncate = a->rope_truncate;
        k.beta_fast = a->rope_beta_fast;
        k.beta_slow = a->rope_beta_slow;
        k.mscale = a->rope_mscale;
        k.mscale_all_dim = a->rope_mscale_all_dim;
    }
    return k;
}

/* YaRN's magnitude correction for a context stretched by `scale`. */
static double yarn_mscale(double scale, double m)
{
    return scale <= 1.0 ? 1.0 : 0.1 * m * log(scale) + 1.0;
}

/* The (fractional) pair index whose wavelength fits `rotations` times into the trained
 * context: below it pairs turn faster (extrapolated), above it slower (interpolated). */
static double correction_dim(double rotations, double r, double theta, double orig)
{
    return r * log(orig / (rotations * 2.0 * ROPE_PI)) / (2.0 * log(theta));
}

/* transformers' _compute_yarn_parameters: pairs below `low` keep theta's frequency, pairs
 * above `high` take it divided by factor, a linear ramp between. */
static void yarn_freqs(const kt__rope_key *k, kt__rope_freqs *f)
{
    const double r = k->rotary_dim, theta = k->theta, factor = k->factor;
    double low = correction_dim(k->beta_fast, r, theta, (double)k->original_max_positions);
    double high = correction_dim(k->beta_slow, r, theta, (double)k->original_max_positions);
    if (k->truncate) {
        low = floor(low);
        high = ceil(high);
    }
    low = fmax(low, 0.0);
    high = fmin(high, r - 1.0);
    if (low == high)
        high += 0.001; /* as transformers does: no division by zero */
    for (int j = 0; j < f->half; j++) {
        const double ramp = fmin(fmax(((double)j - low) / (high - low), 0.0), 1.0);
        const double keep = 1.0 - ramp; /* the extrapolated frequency's weight */
        const double base = pow(theta, -2.0 * j / r);
        f->inv_freq[j] = base / factor * (1.0 - keep) + base * keep;
    }
    if (k->attention_factor != 0.0f)
        f->attn = k->attention_factor;
    else if (k->mscale != 0.0f && k->mscale_all_dim != 0.0f) /* DeepSeek's split */
        f->attn = yarn_mscale(factor, k->mscale) / yarn_mscale(factor, k->mscale_all_dim);
    else
        f->attn = yarn_mscale(factor, 1.0);
}

void kt__rope_freqs_of(const kt__rope_key *k, kt__rope_freqs *f)
{
    f->half = k->rotary_dim / 2;
    if (k->scaling == KT_ROPE_SCALING_YARN) {
        yarn_freqs(k, f);
        return;
    }
    const double r = k->rotary_dim;
    const double div = k->scaling == KT_ROPE_SCALING_LINEAR ? (double)k->factor : 1.0;
    for (int j = 0; j < f->half; j++)
        f->inv_freq[j] = pow((double)k->theta, -2.0 * j / r) / div;
    f->attn = k->attention_factor != 0.0f ? (double)k->attention_factor : 1.0;
}

void kt__rope_angles(const kt__rope_freqs *f, int64_t pos, float *cos_out, float *sin_out)
{
    for (int j = 0; j < f->half; j++) {
        const double a = (double)pos * f->inv_freq[j];
        cos_out[j] = (float)(f->attn * cos(a));
        sin_out[j] = (float)(f->attn * sin(a));
    }
}
