/* rope: rotary position embedding of x [B,T,H,D] or [T,H,D] at positions [B,T] or [T]
 * (absent: 0..T-1).
 *
 * The first r = rotary_dim elements of each head are r/2 pairs; pair j of a token at
 * position p turns by p * inv_freq_j (rope_freqs.c): (a, b) -> (a cos - b sin, b cos + a sin),
 * cos and sin already scaled by the attention factor. Where a pair sits is a layout: rotate_half
 * (j, j + r/2) for Llama, Mixtral, Qwen and OLMoE; interleaved (2j, 2j+1) for DeepSeek's MLA,
 * whose V2 writes the results back there and whose V3 (deinterleave) writes them to
 * (j, j + r/2). Elements r..D-1 pass through. The backward applies the transpose: the pair
 * turned back, read in the output's layout and written in the input's.
 *
 * In a session the cos/sin come from the table bind built (rope_state.c); a direct call
 * computes each token's with the function that fills the table. The graph runs kernels
 * without per-call checks, so the kernels check the positions themselves, before writing. */
#include <float.h>
#include <string.h>

#include "lib/ops/op_desc.h"
#include "lib/ops/op_state.h"
#include "lib/ops/op_util.h"
#include "lib/ops/rope.h"

/* ---- checks -------------------------------------------------------------------------------- */

static kt_status check_rotary(const kt_op_attrs *at, int64_t d)
{
    const int r = at->rope_rotary_dim;
    if (r == 0) {
        if (d % 2 != 0)
            return kt__error(KT_EINVAL, "rope: x: head dim D = %lld is odd and rotary_dim is 0 "
                             "(all of it rotates), expected an even D or an even rotary_dim "
                             "below it", (long long)d);
        if (d > KT__ROPE_MAX_ROTARY)
            return kt__error(KT_EINVAL, "rope: x: head dim D = %lld rotates whole with "
                             "rotary_dim 0, expected at most %d rotated elements (set "
                             "rotary_dim)", (long long)d, KT__ROPE_MAX_ROTARY);
        return KT_OK;
    }
    if (r < 0 || r % 2 != 0)
        return kt__error(KT_EINVAL, "rope: attribute rotary_dim = %d, expected an even count "
                         "(elements rotate in pairs)", r);
    if (r > d)
        return kt__error(KT_EINVAL, "rope: attribute rotary_dim = %d exceeds x's head dim D = "
                         "%lld", r, (long long)d);
    return KT_OK;
}

static kt_status check_combination(const kt_op_attrs *at)
{
    if (at->rope_deinterleave && !at->rope_interleaved)
        return kt__error(KT_EINVAL, "rope: attribute deinterleave = 1 needs interleaved = 1 "
                         "(it writes interleaved pairs as [evens | odds])");
    if (at->rope_scaling == KT_ROPE_SCALING_YARN && at->rope_original_max_positions <= 0)
        return kt__error(KT_EINVAL, "rope: scaling = yarn needs attribute "
                         "original_max_positions (transformers: rope_scaling's "
                         "original_max_position_embeddings, else max_position_embeddings)");
    return KT_OK;
}

/* positions: [T], or [B,T] when x is [B,T,H,D]. */
static kt_status check_positions_shape(const kt_tensor *x, const kt_tensor *pos)
{
    KT__TRY(kt__check_index("rope", "positions", pos));
    const int64_t t_len = x->shape[x->ndim - 3];
    const int is_t = pos->ndim == 1 && pos->shape[0] == t_len;
    const int is_bt = x->ndim == 4 && pos->ndim == 2 && pos->shape[0] == x->shape[0] &&
                      pos->shape[1] == t_len;
    if (is_t || is_bt)
        return KT_OK;
    char dp[96], dx[96];
    kt_tensor_describe(pos, dp, sizeof dp);
    kt_tensor_describe(x, dx, sizeof dx);
    if (x->ndim == 4)
        return kt__error(KT_EINVAL, "rope: positions must be [T] = [%lld] or [B,T] = "
                         "[%lld,%lld] for x %s, got %s", (long long)t_len,
                         (long long)x->shape[0], (long long)t_len, dx, dp);
    return kt__error(KT_EINVAL, "rope: positions must be [T] = [%lld] for x %s, got %s",
                     (long long)t_len, dx, dp);
}

static kt_status infer_rope(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    const kt_tensor *x = &in[0];
    KT__TRY(kt__check_float("rope", "x", x));
    KT__TRY(kt__check_rank("rope", "x", x, 3, 4));
    KT__TRY(check_rotary(at, x->shape[x->ndim - 1]));
    KT__TRY(check_combination(at));
    const int64_t t_len = x->shape[x->ndim - 3];
    if (n > 1)
        KT__TRY(check_positions_shape(x, &in[1]));
    else if (t_len > at->rope_max_positions)
        return kt__error(KT_EINVAL, "rope: x has T = %lld tokens and no positions input "
                         "(positions 0..T-1), expected T <= max_positions = %lld",
                         (long long)t_len, (long long)at->rope_max_positions);
    kt__like(&out[0], x);
    return KT_OK;
}

/* per rotated pair: 4 multiplies and 2 adds */
static double flops_rope(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)n;
    const int64_t d = kt__row_len(&in[0]);
    const int64_t r = at->rope_rotary_dim > 0 ? at->rope_rotary_dim : d;
    return 3.0 * (double)r * (double)(kt_tensor_numel(&in[0]) / (d > 0 ? d : 1));
}

/* Every position in 0..max_positions-1, checked before anything is written. */
static kt_status check_positions(const kt_tensor *pos, int64_t max_positions)
{
    const int64_t n = kt_tensor_numel(pos);
    for (int64_t i = 0; i < n; i++) {
        const int64_t p = kt__index_at(pos, i);
        if (p >= 0 && p < max_positions)
            continue;
        if (pos->ndim == 2)
            return kt__error(KT_EINVAL, "rope: positions: entry %lld (batch %lld, t %lld) = "
                             "%lld, expected 0..%lld (max_positions = %lld)", (long long)i,
                             (long long)(i / pos->shape[1]), (long long)(i % pos->shape[1]),
                             (long long)p, (long long)(max_positions - 1),
                             (long long)max_positions);
        return kt__error(KT_EINVAL, "rope: positions: entry %lld = %lld, expected 0..%lld "
                         "(max_positions = %lld)", (long long)i, (long long)p,
                         (long long)(max_positions - 1), (long long)max_positions);
    }
    return KT_OK;
}

/* ---- kernels ------------------------------------------------------------------------------- */

/* Where pair j's two elements sit in a head: j*step and j*step + second. */
enum { LAYOUT_HALF = 0, LAYOUT_INTERLEAVED = 1 };

typedef struct rope_job {
    const kt_tensor *src; /* forward: x; backward: the output gradient */
    kt_tensor *dst;       /* forward: y; backward: x's gradient */
    const kt_tensor *pos; /* NULL: position = t */
    int64_t t_len, heads, d;
    int pos_per_batch; /* positions are [B,T] */
    int r, half;
    int from, to; /* the layouts read and written */
    int back;     /* the transposed turn (sin negated) */
    const kt__rope_table *table;
    const kt__rope_freqs *freqs; /* without a table */
} rope_job;

static int64_t position_of(const rope_job *j, int64_t token)
{
    if (j->pos == NULL)
        return token % j->t_len;
    return kt__index_at(j->pos, j->pos_per_batch ? token : token % j->t_len);
}

/* One head's pairs from a (layout fs/fo) into o (layout ts/to), turned forward or back (the
 * transpose: sin negated, written as the other sign so that no multiply is added). Constant
 * layouts and direction once inlined, so each form gets its own loop. */
static inline void turn(const float *restrict a, float *restrict o, const float *c,
                        const float *s, int half, int fs, int fo, int ts, int to, int back)
{
    if (back)
        for (int j = 0; j < half; j++) {
            const float x0 = a[j * fs], x1 = a[j * fs + fo];
            o[j * ts] = x0 * c[j] + x1 * s[j];
            o[j * ts + to] = x1 * c[j] - x0 * s[j];
        }
    else
        for (int j = 0; j < half; j++) {
            const float x0 = a[j * fs], x1 = a[j * fs + fo];
            o[j * ts] = x0 * c[j] - x1 * s[j];
            o[j * ts + to] = x1 * c[j] + x0 * s[j];
        }
}

#define TURN_ALL_LAYOUTS(back)                                                               \
    do {                                                                                     \
        if (j->from == LAYOUT_HALF && j->to == LAYOUT_HALF)                                  \
            turn(a, o, c, s, h, 1, h, 1, h, back);                                           \
        else if (j->from == LAYOUT_INTERLEAVED && j->to == LAYOUT_INTERLEAVED)               \
            turn(a, o, c, s, h, 2, 1, 2, 1, back);                                           \
        else if (j->from == LAYOUT_INTERLEAVED)                                              \
            turn(a, o, c, s, h, 2, 1, 1, h, back);                                           \
        else                                                                                 \
            turn(a, o, c, s, h, 1, h, 2, 1, back);                                           \
    } while (0)

static void turn_row(const rope_job *j, const float *a, float *o, const float *c,
                     const float *s)
{
    const int h = j->half;
    if (j->back)
        TURN_ALL_LAYOUTS(1);
    else
        TURN_ALL_LAYOUTS(0);
}

/* o (n floats) into t at element i. */
static void store(kt_tensor *t, int64_t i, int64_t n, const float *o)
{
    if (t->dtype == KT_F32)
        memcpy((float *)t->data + i, o, (size_t)n * sizeof *o);
    else
        kt__store_commit(t, i, n, o);
}

static void rope_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const rope_job *j = ctx;
    float abuf[KT__ROPE_MAX_ROTARY], obuf[KT__ROPE_MAX_ROTARY];
    float cbuf[KT__ROPE_MAX_ROTARY / 2], sbuf[KT__ROPE_MAX_ROTARY / 2];
    const float *c = cbuf, *s = sbuf;
    const size_t esize = kt_dtype_size(j->src->dtype);
    const int copy_rest = j->d > j->r && j->dst->data != j->src->data;
    int64_t have = -1; /* the position c and s hold (rows of a token share it) */
    for (int64_t row = begin; row < end; row++) {
        const int64_t p = position_of(j, row / j->heads);
        if (p != have) {
            if (j->table != NULL) {
                c = j->table->cos + p * j->half;
                s = j->table->sin + p * j->half;
            } else {
                kt__rope_angles(j->freqs, p, cbuf, sbuf);
            }
            have = p;
        }
        const int64_t off = row * j->d;
        /* the whole rotated part is read before any of it is written: safe in place */
        const float *a = kt__load_f32(j->src, off, j->r, abuf);
        turn_row(j, a, obuf, c, s);
        store(j->dst, off, j->r, obuf);
        if (copy_rest)
            memcpy((char *)j->dst->data + (size_t)(off + j->r) * esize,
                   (const char *)j->src->data + (size_t)(off + j->r) * esize,
                   (size_t)(j->d - j->r) * esize);
    }
}

static kt_status run_rope(const kt__op_call *call, const kt_tensor *src, kt_tensor *dst,
                          int back)
{
    const kt_op_attrs *at = call->attrs;
    const kt_tensor *x = &call->in[0];
    const kt_tensor *pos = call->n_in > 1 ? &call->in[1] : NULL;
    if (pos != NULL)
        KT__TRY(check_positions(pos, at->rope_max_positions));
    const int64_t d = x->shape[x->ndim - 1];
    const kt__rope_key key = kt__rope_key_of(at, d);
    const int interleaved = at->rope_interleaved ? LAYOUT_INTERLEAVED : LAYOUT_HALF;
    const int out_layout = at->rope_deinterleave ? LAYOUT_HALF : interleaved;
    kt__rope_freqs freqs;
    rope_job j = {.src = src, .dst = dst, .pos = pos, .t_len = x->shape[x->ndim - 3],
                  .heads = x->shape[x->ndim - 2], .d = d,
                  .pos_per_batch = pos != NULL && pos->ndim == 2, .r = key.rotary_dim,
                  .half = key.rotary_dim / 2, .from = back ? out_layout : interleaved,
                  .to = back ? interleaved : out_layout, .back = back,
                  .table = kt__rope_find(call->state, &key), .freqs = &freqs};
    if (j.table == NULL)
        kt__rope_freqs_of(&key, &freqs);
    const int64_t rows = kt_tensor_numel(x) / (d > 0 ? d : 1);
    kt_parallel_for(call->pool, rows, kt__rows_grain(d), rope_rows, &j);
    return KT_OK;
}

static kt_status fwd_rope(const kt__op_call *c)
{
    return run_rope(c, &c->in[0], &c->out_w[0], 0);
}

static kt_status bwd_rope(const kt__op_call *c)
{
    if (c->gin[0].data == NULL) {
        /* nothing to write, but a bad position is the same error as in forward */
        return c->n_in > 1 ? check_positions(&c->in[1], c->attrs->rope_max_positions) : KT_OK;
    }
    return run_rope(c, &c->gout[0], &c->gin[0], 1);
}

/* ---- the table row ------------------------------------------------------------------------- */

static const char *const rope_scaling_names[] = {"none", "linear", "yarn"};

static const kt__attr_desc rope_attrs[] = {
    KT__A_FLOAT("theta", rope_theta, 10000.0, 2.0, FLT_MAX,
                "the frequency base: pair j turns by position * theta^(-2j/rotary_dim)"),
    KT__A_INT("rotary_dim", rope_rotary_dim, 0, 0, KT__ROPE_MAX_ROTARY,
              "the first elements of each head that rotate, even (the rest pass through); "
              "0: all D"),
    KT__A_BOOL("interleaved", rope_interleaved, 0,
               "pairs (2j, 2j+1) as DeepSeek's MLA; 0: pairs (j, j+rotary_dim/2), rotate_half"),
    KT__A_BOOL("deinterleave", rope_deinterleave, 0,
               "with interleaved: pair j's results go to j and j+rotary_dim/2, [evens, odds] "
               "(DeepSeek-V3's apply_rotary_pos_emb_interleave)"),
    KT__A_I64("max_positions", rope_max_positions, 4096, 1, INT32_MAX,
              "positions run 0..max_positions-1 (a session's cos/sin table holds them)"),
    KT__A_ENUM("scaling", rope_scaling, KT_ROPE_SCALING_NONE, rope_scaling_names,
               "linear: positions / factor; yarn: YaRN's frequency blend (kt_rope_scaling)"),
    KT__A_FLOAT("factor", rope_factor, 1.0, 1e-6, FLT_MAX,
                "linear and yarn: the context stretch (rope_scaling.factor)"),
    KT__A_I64("original_max_positions", rope_original_max_positions, 0, 0, INT32_MAX,
              "yarn (required there): the trained context, original_max_position_embeddings"),
    KT__A_FLOAT("beta_fast", rope_beta_fast, 32.0, 1e-6, FLT_MAX,
                "yarn: pairs turning more often than this over the trained context keep "
                "their frequency"),
    KT__A_FLOAT("beta_slow", rope_beta_slow, 1.0, 1e-6, FLT_MAX,
                "yarn: pairs turning less often than this take it divided by factor"),
    KT__A_FLOAT("mscale", rope_mscale, 0.0, 0.0, FLT_MAX,
                "yarn: with mscale_all_dim, attention factor m(mscale) / m(mscale_all_dim), "
                "m(s) = 0.1 s ln(factor) + 1"),
    KT__A_FLOAT("mscale_all_dim", rope_mscale_all_dim, 0.0, 0.0, FLT_MAX,
                "yarn: see mscale (either 0: the attention factor is m(1))"),
    KT__A_FLOAT("attention_factor", rope_attention_factor, 0.0, 0.0, FLT_MAX,
                "multiplies cos and sin; 0: yarn's derived factor, 1 otherwise"),
    KT__A_BOOL("truncate", rope_truncate, 1,
               "yarn: the correction range rounded outwards to whole pairs"),
};

const kt__op_desc kt__op_rope = {
    .name = "rope", .min_in = 1, .max_in = 2, .n_out = 1, .inplace_in = 1u,
    .bwd_reads_in = 2u, .no_grad_in = 2u, .infer = infer_rope, .flops = flops_rope,
    .forward = fwd_rope, .backward = bwd_rope, KT__ATTR_LIST(rope_attrs),
    .state = &kt__rope_state};
