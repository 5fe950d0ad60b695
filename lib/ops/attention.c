/* attention: o = softmax(scale q k^T, over the keys each query sees) v, and lse, the
 * log-sum-exp of each query's scores, computed in blocks (flash attention) so that no T x S
 * matrix ever exists.
 *
 * Forward: one task per (batch, query head, block of BQ queries). The block is held
 * transposed (queries along the vector lanes): S^T = K Q^T block by block of BK keys, an
 * online softmax down its columns, O^T += V^T P^T; blocks no query of the task can see (the
 * causal future, beyond the window, other documents) are skipped. Only o and lse are kept.
 *
 * Backward over recomputed blocks, with di = rowsum(dO o) - dlse, p = exp(s - lse),
 * dp = dO v^T, ds = p (dp - di). When the (batch, KV head) pairs share out evenly over the
 * threads (a multiple of them, or at least 4 a thread) it is fused: one task per pair owns that head's dk and dv, walks its query heads and blocks, and
 * finishes each block's dq over its key blocks (five products a block pair). With fewer, two
 * passes share the work more finely at the price of recomputing s and dp: pass 1 has one task
 * per (batch, KV head, key block) for dk and dv, pass 2 one per (batch, query head, query
 * block) for dq. Either way every gradient element is summed by one task in a fixed order, so
 * the results depend on the thread count only through that choice. lse is an output like o:
 * a gradient given for it (a zero one when nothing uses it) enters through di.
 *
 * A query that sees no key gets o = 0 and lse = 0 (not log 0 = -inf), and no gradient. The
 * per-thread blocks live on the stack (KT__THREAD_STACK_BYTES, as the other kernels' tiles),
 * so D and Dv are bounded; scratch holds di (one float per query row) and, for bf16/f16, the
 * fused backward's f32 sums of dk and dv. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "kt/tensor.h"
#include "lib/kernels/attn_block.h"
#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

#define BQ 64     /* queries of a block */
#define BK 64     /* keys of a block */
#define D_MAX 256 /* head dims D and Dv */

static int64_t pad16(int64_t n) { return (n + 15) & ~(int64_t)15; }

/* ---- shapes ------------------------------------------------------------------------------- */

static kt_status infer_attention(const kt_op_attrs *at, const kt_tensor *in, int n,
                                 kt_tensor *out)
{
    (void)at;
    const char *op = "attention";
    const kt_tensor *q = &in[0], *k = &in[1], *v = &in[2];
    KT__TRY(kt__check_float(op, "q", q));
    KT__TRY(kt__check_rank(op, "q", q, 4, 4));
    KT__TRY(kt__check_same_dtype(op, "k", k, q));
    KT__TRY(kt__check_rank(op, "k", k, 4, 4));
    KT__TRY(kt__check_same_dtype(op, "v", v, q));
    KT__TRY(kt__check_rank(op, "v", v, 4, 4));
    const int64_t B = q->shape[0], T = q->shape[1], Hq = q->shape[2], D = q->shape[3];
    KT__TRY(kt__check_dim(op, "k (batch)", k, 0, B));
    KT__TRY(kt__check_dim(op, "k (head dim, as q's)", k, 3, D));
    const int64_t S = k->shape[1], Hkv = k->shape[2];
    KT__TRY(kt__check_dim(op, "v (batch)", v, 0, B));
    KT__TRY(kt__check_dim(op, "v (keys, as k's)", v, 1, S));
    KT__TRY(kt__check_dim(op, "v (KV heads, as k's)", v, 2, Hkv));
    const int64_t Dv = v->shape[3];
    if (Hkv < 1 || Hq % Hkv != 0)
        return kt__error(KT_EINVAL, "attention: k: its %lld KV heads must divide q's %lld "
                         "query heads", (long long)Hkv, (long long)Hq);
    if (D < 1 || D > D_MAX)
        return kt__error(KT_EINVAL, "attention: q: head dim %lld is not in 1..%d",
                         (long long)D, D_MAX);
    if (Dv < 1 || Dv > D_MAX)
        return kt__error(KT_EINVAL, "attention: v: head dim %lld is not in 1..%d",
                         (long long)Dv, D_MAX);
    if (n == 4) {
        const kt_tensor *sg = &in[3];
        KT__TRY(kt__check_index(op, "segments", sg));
        KT__TRY(kt__check_rank(op, "segments", sg, 2, 2));
        KT__TRY(kt__check_dim(op, "segments (batch)", sg, 0, B));
        KT__TRY(kt__check_dim(op, "segments (keys, as k's)", sg, 1, S));
        if (S < T)
            return kt__error(KT_EINVAL, "attention: segments: query t takes the segment of "
                             "key S-T+t, so S (%lld) must be at least T (%lld)",
                             (long long)S, (long long)T);
    }
    const int64_t os[4] = {B, T, Hq, Dv}, ls[3] = {B, Hq, T};
    kt__shape_out(&out[0], q->dtype, 4, os);
    kt__shape_out(&out[1], KT_F32, 3, ls);
    return KT_OK;
}

/* ---- what a query sees ---------------------------------------------------------------------- */

typedef struct attn_job {
    const kt_tensor *q, *k, *v, *seg, *o, *go, *glse;
    kt_tensor *ow, *dq, *dk, *dv;
    float *lse, *di;
    float *acc_k, *acc_v; /* the fused backward's f32 sums of dk and dv */
    const float *lse_in;
    int64_t B, T, S, Hq, Hkv, G, D, Dv, off, window, nqb, nkb;
    float scale, cap;
    int causal;
} attn_job;

static void job_init(attn_job *j, const kt_op_attrs *at, const kt_tensor *in, int n_in)
{
    memset(j, 0, sizeof *j);
    j->q = &in[0], j->k = &in[1], j->v = &in[2];
    j->seg = n_in == 4 ? &in[3] : NULL;
    j->B = j->q->shape[0], j->T = j->q->shape[1], j->Hq = j->q->shape[2];
    j->D = j->q->shape[3], j->S = j->k->shape[1], j->Hkv = j->k->shape[2];
    j->Dv = j->v->shape[3];
    j->G = j->Hq / j->Hkv;
    j->off = j->S - j->T;
    j->window = at->attn_window;
    j->causal = at->attn_causal;
    j->scale = at->attn_scale > 0.0f ? at->attn_scale : (float)(1.0 / sqrt((double)j->D));
    j->cap = at->attn_softcap;
    j->nqb = (j->T + BQ - 1) / BQ;
    j->nkb = (j->S + BK - 1) / BK;
}

/* Key range [lo, hi) that query position p (= t + S - T) may see, segments aside. */
static void key_range(const attn_job *j, int64_t p, int64_t *lo, int64_t *hi)
{
    int64_t a = 0, b = j->S;
    if (j->causal && p + 1 < b)
        b = p + 1 > 0 ? p + 1 : 0;
    if (j->window > 0 && p - j->window + 1 > a)
        a = p - j->window + 1;
    *lo = a;
    *hi = b > a ? b : a;
}

static int64_t seg_at(const attn_job *j, int64_t b, int64_t pos)
{
    return kt__index_at(j->seg, b * j->S + pos);
}

enum { BLOCK_NONE = 0, BLOCK_PARTIAL = 1, BLOCK_FULL = 2 };

/* Whether queries [t0, t0+nq) see keys [k0, k0+nk) of batch b: none, some or all. */
static int block_kind(const attn_job *j, int64_t b, int64_t t0, int64_t nq, int64_t k0,
                      int64_t nk)
{
    const int64_t p_lo = t0 + j->off, p_hi = t0 + nq - 1 + j->off, k_hi = k0 + nk - 1;
    int64_t lo_a, hi_a, lo_b, hi_b;
    key_range(j, p_lo, &lo_a, &hi_a);
    key_range(j, p_hi, &lo_b, &hi_b);
    /* both bounds grow with p: the union of ranges is [lo_a, hi_b), the intersection
     * [lo_b, hi_a) */
    if (k0 >= hi_b || k_hi < lo_a || hi_b <= lo_a)
        return BLOCK_NONE;
    int kind = k0 >= lo_b && k_hi < hi_a ? BLOCK_FULL : BLOCK_PARTIAL;
    if (j->seg == NULL)
        return kind;
    /* queries sit at positions >= 0 here (segments need S >= T) */
    int64_t qmin = INT64_MAX, qmax = INT64_MIN, kmin = INT64_MAX, kmax = INT64_MIN;
    for (int64_t i = p_lo; i <= p_hi; i++) {
        const int64_t s = seg_at(j, b, i);
        qmin = s < qmin ? s : qmin, qmax = s > qmax ? s : qmax;
    }
    for (int64_t i = k0; i <= k_hi; i++) {
        const int64_t s = seg_at(j, b, i);
        kmin = s < kmin ? s : kmin, kmax = s > kmax ? s : kmax;
    }
    if (qmax < kmin || kmax < qmin)
        return BLOCK_NONE;
    return qmin == qmax && kmin == kmax && qmin == kmin ? kind : BLOCK_PARTIAL;
}

/* Sets the scores of pairs the queries do not see to -inf; the block holds keys along rows
 * and queries along columns (keys_rows), or the other way round. Each query's visible keys
 * are one range (key_range) less, with segments, the keys of other documents. */
static void mask_block(const attn_job *j, int64_t b, int64_t t0, int64_t nq, int64_t k0,
                       int64_t nk, float *s, int64_t ld, int keys_rows)
{
    int64_t kseg[BK];
    if (j->seg)
        for (int64_t c = 0; c < nk; c++)
            kseg[c] = seg_at(j, b, k0 + c);
    const int64_t rs = keys_rows ? ld : 1, cs = keys_rows ? 1 : ld; /* key, query steps */
    for (int64_t i = 0; i < nq; i++) {
        int64_t lo, hi;
        key_range(j, t0 + i + j->off, &lo, &hi);
        lo = lo < k0 ? 0 : lo - k0 > nk ? nk : lo - k0;
        hi = hi < k0 ? 0 : hi - k0 > nk ? nk : hi - k0;
        hi = hi < lo ? lo : hi;
        float *col = s + i * cs;
        for (int64_t c = 0; c < lo; c++)
            col[c * rs] = -INFINITY;
        for (int64_t c = hi; c < nk; c++)
            col[c * rs] = -INFINITY;
        if (j->seg) {
            const int64_t qs = seg_at(j, b, t0 + i + j->off);
            for (int64_t c = lo; c < hi; c++)
                if (kseg[c] != qs)
                    col[c * rs] = -INFINITY;
        }
    }
}

/* Query blocks in the order 0, n-1, 1, n-2, ...: a contiguous share of the tasks then holds
 * as many long (late, causal) blocks as short ones. */
static int64_t zigzag(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

/* ---- moving rows between tensors and f32 blocks ------------------------------------------ */

/* rows r < n of width w (elements ld apart, from element `at` of t) as f32 rows ld_out
 * apart: a pointer into t for f32 (ld_out = ld), else converted into buf (ld_out = w). */
static const float *rows_f32(const kt_tensor *t, int64_t at, int64_t ld, int64_t n, int64_t w,
                             float *buf, int64_t *ld_out)
{
    if (t->dtype == KT_F32) {
        *ld_out = ld;
        return (const float *)t->data + at;
    }
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *src = (const uint16_t *)t->data + at + r * ld;
        if (t->dtype == KT_BF16)
            kt_bf16_to_f32(buf + r * w, src, (size_t)w);
        else
            kt_f16_to_f32(buf + r * w, src, (size_t)w);
    }
    *ld_out = w;
    return buf;
}

/* dst[c ldd + r] = f * rows r < n of width w (from element `at`, ld apart), zeros for
 * r in [n, ldd) (the block's padding columns); bf16/f16 rows are widened into tmp. */
/* The same rows always in buf, contiguous: for the operand a block product reads for every
 * row tile (rows a multiple of 4 KiB apart, as the heads put them, share L1 sets). */
static const float *rows_packed(const kt_tensor *t, int64_t at, int64_t ld, int64_t n,
                                int64_t w, float *buf, int64_t *ld_out)
{
    if (t->dtype != KT_F32)
        return rows_f32(t, at, ld, n, w, buf, ld_out);
    for (int64_t r = 0; r < n; r++)
        memcpy(buf + r * w, (const float *)t->data + at + r * ld, (size_t)w * sizeof *buf);
    *ld_out = w;
    return buf;
}

static void load_transposed(const kt_tensor *t, int64_t at, int64_t ld, int64_t n, int64_t w,
                            float f, float *dst, int64_t ldd, float *tmp)
{
    int64_t ldx;
    const float *x = rows_f32(t, at, ld, n, w, tmp, &ldx);
    kt__attn_transpose(n, w, x, ldx, f, dst, ldd);
}

/* Row r < n of t (width w, from element `at`, ld apart) = f * src[c lds + r] (a transposed
 * block), rounded to t's dtype. */
static void store_transposed(kt_tensor *t, int64_t at, int64_t ld, int64_t n, int64_t w,
                             const float *src, int64_t lds, const float *f)
{
    float row[D_MAX];
    for (int64_t r = 0; r < n; r++) {
        float *dst = kt__store_ptr(t, at + r * ld, row);
        for (int64_t c = 0; c < w; c++)
            dst[c] = f[r] * src[c * lds + r];
        kt__store_commit(t, at + r * ld, w, row);
    }
}

/* Rows r < n of t = f * src[r lds + c] */
static void store_rows(kt_tensor *t, int64_t at, int64_t ld, int64_t n, int64_t w,
                       const float *src, int64_t lds, float f)
{
    float row[D_MAX];
    for (int64_t r = 0; r < n; r++) {
        float *dst = kt__store_ptr(t, at + r * ld, row);
        for (int64_t c = 0; c < w; c++)
            dst[c] = f * src[r * lds + c];
        kt__store_commit(t, at + r * ld, w, row);
    }
}

/* element offsets of q/o rows (b, t, h), k/v rows (b, s, kvh), lse rows (b, h, t) */
static int64_t q_at(const attn_job *j, int64_t b, int64_t t, int64_t h, int64_t w)
{
    return ((b * j->T + t) * j->Hq + h) * w;
}

static int64_t kv_at(const attn_job *j, int64_t b, int64_t s, int64_t kh, int64_t w)
{
    return ((b * j->S + s) * j->Hkv + kh) * w;
}

static int64_t lse_at(const attn_job *j, int64_t b, int64_t h, int64_t t)
{
    return (b * j->Hq + h) * j->T + t;
}

/* ---- forward ------------------------------------------------------------------------------- */

static void fwd_tasks(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const attn_job *j = ctx;
    _Alignas(64) float qt[D_MAX * BQ], ot[D_MAX * BQ], st[BK * BQ];
    _Alignas(64) float kbuf[BK * D_MAX], vbuf[BK * D_MAX];
    _Alignas(64) float m[BQ], l[BQ], alpha[BQ], inv[BQ];
    for (int64_t task = begin; task < end; task++) {
        const int64_t bh = task / j->nqb, qb = zigzag(task % j->nqb, j->nqb);
        const int64_t b = bh / j->Hq, h = bh % j->Hq, kh = h / j->G;
        const int64_t t0 = qb * BQ, nq = j->T - t0 < BQ ? j->T - t0 : BQ, nqp = pad16(nq);
        load_transposed(j->q, q_at(j, b, t0, h, j->D), j->Hq * j->D, nq, j->D, j->scale, qt,
                        nqp, kbuf);
        memset(ot, 0, (size_t)(j->Dv * nqp) * sizeof *ot);
        for (int64_t i = 0; i < nqp; i++)
            m[i] = -INFINITY, l[i] = 0.0f;
        int64_t klo, khi, unused;
        key_range(j, t0 + j->off, &klo, &unused);
        key_range(j, t0 + nq - 1 + j->off, &unused, &khi);
        for (int64_t k0 = klo / BK * BK; k0 < khi; k0 += BK) {
            const int64_t nk = j->S - k0 < BK ? j->S - k0 : BK;
            const int kind = block_kind(j, b, t0, nq, k0, nk);
            if (kind == BLOCK_NONE)
                continue;
            int64_t ldk, ldv;
            const float *kr = rows_f32(j->k, kv_at(j, b, k0, kh, j->D), j->Hkv * j->D, nk, j->D,
                                       kbuf, &ldk);
            kt__attn_gemm(nk, nqp, j->D, kr, ldk, 1, qt, nqp, st, nqp, 0);
            if (j->cap > 0.0f)
                kt__attn_softcap(nk, nqp, st, nqp, j->cap);
            if (kind == BLOCK_PARTIAL)
                mask_block(j, b, t0, nq, k0, nk, st, nqp, 1);
            kt__attn_online_cols(nk, nqp, st, nqp, m, l, alpha);
            kt__attn_scale_cols(j->Dv, nqp, ot, nqp, alpha);
            const float *vr = rows_f32(j->v, kv_at(j, b, k0, kh, j->Dv), j->Hkv * j->Dv, nk,
                                       j->Dv, vbuf, &ldv);
            kt__attn_gemm(j->Dv, nqp, nk, vr, 1, ldv, st, nqp, ot, nqp, 1);
        }
        for (int64_t i = 0; i < nq; i++) {
            const int seen = l[i] > 0.0f;
            inv[i] = seen ? 1.0f / l[i] : 0.0f;
            j->lse[lse_at(j, b, h, t0 + i)] = seen ? m[i] + logf(l[i]) : 0.0f;
        }
        store_transposed(j->ow, q_at(j, b, t0, h, j->Dv), j->Hq * j->Dv, nq, j->Dv, ot, nqp,
                         inv);
    }
}

static kt_status fwd_attention(const kt__op_call *c)
{
    attn_job j;
    job_init(&j, c->attrs, c->in, c->n_in);
    j.ow = &c->out_w[0];
    j.lse = c->out_w[1].data;
    kt_parallel_for(c->pool, j.B * j.Hq * j.nqb, 1, fwd_tasks, &j);
    return KT_OK;
}

/* ---- backward ------------------------------------------------------------------------------ */

/* di = sum over dv of dO o, minus the gradient of lse */
static void di_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const attn_job *j = ctx;
    float gbuf[D_MAX], obuf[D_MAX];
    const float *glse = j->glse->data;
    for (int64_t r = begin; r < end; r++) { /* r runs over (b, t, h) like o's rows */
        const float *g = kt__load_f32(j->go, r * j->Dv, j->Dv, gbuf);
        const float *o = kt__load_f32(j->o, r * j->Dv, j->Dv, obuf);
        float s = 0.0f;
        for (int64_t c = 0; c < j->Dv; c++)
            s += g[c] * o[c];
        const int64_t h = r % j->Hq, bt = r / j->Hq;
        const int64_t at = lse_at(j, bt / j->T, h, bt % j->T);
        j->di[at] = s - glse[at];
    }
}

/* Pass 1: dk and dv of one key block of one KV head, over its query heads and blocks. */
static void dkv_tasks(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const attn_job *j = ctx;
    _Alignas(64) float kt[D_MAX * BK], vt[D_MAX * BK], dk[BK * D_MAX], dv[BK * D_MAX];
    _Alignas(64) float s[BQ * BK], dp[BQ * BK], qbuf[BQ * D_MAX], gbuf[BQ * D_MAX];
    const int want_k = j->dk != NULL, want_v = j->dv != NULL;
    for (int64_t task = begin; task < end; task++) {
        const int64_t bk = task / j->nkb, kb = zigzag(task % j->nkb, j->nkb);
        const int64_t b = bk / j->Hkv, kh = bk % j->Hkv;
        const int64_t k0 = kb * BK, nk = j->S - k0 < BK ? j->S - k0 : BK, nkp = pad16(nk);
        load_transposed(j->k, kv_at(j, b, k0, kh, j->D), j->Hkv * j->D, nk, j->D, j->scale, kt,
                        nkp, qbuf);
        load_transposed(j->v, kv_at(j, b, k0, kh, j->Dv), j->Hkv * j->Dv, nk, j->Dv, 1.0f, vt,
                        nkp, qbuf);
        memset(dk, 0, (size_t)(nk * j->D) * sizeof *dk);
        memset(dv, 0, (size_t)(nk * j->Dv) * sizeof *dv);
        for (int64_t hg = 0; hg < j->G; hg++) {
            const int64_t h = kh * j->G + hg;
            for (int64_t qb = 0; qb < j->nqb; qb++) {
                const int64_t t0 = qb * BQ, nq = j->T - t0 < BQ ? j->T - t0 : BQ;
                const int kind = block_kind(j, b, t0, nq, k0, nk);
                if (kind == BLOCK_NONE)
                    continue;
                int64_t ldq, ldg;
                const float *qr = rows_packed(j->q, q_at(j, b, t0, h, j->D), j->Hq * j->D, nq,
                                              j->D, qbuf, &ldq);
                const float *gr = rows_packed(j->go, q_at(j, b, t0, h, j->Dv), j->Hq * j->Dv,
                                              nq, j->Dv, gbuf, &ldg);
                kt__attn_gemm(nq, nkp, j->D, qr, ldq, 1, kt, nkp, s, nkp, 0);
                if (j->cap > 0.0f)
                    kt__attn_softcap(nq, nkp, s, nkp, j->cap);
                if (kind == BLOCK_PARTIAL)
                    mask_block(j, b, t0, nq, k0, nk, s, nkp, 0);
                kt__attn_gemm(nq, nkp, j->Dv, gr, ldg, 1, vt, nkp, dp, nkp, 0);
                const int64_t at = lse_at(j, b, h, t0);
                kt__attn_probs_grad(nq, nkp, s, nkp, dp, nkp, j->lse_in + at, j->di + at, 0,
                                    j->cap);
                if (want_v) /* dv += p^T dO */
                    kt__attn_gemm(nk, j->Dv, nq, s, 1, nkp, gr, ldg, dv, j->Dv, 1);
                if (want_k) /* dk += ds^T q (scale at the end) */
                    kt__attn_gemm(nk, j->D, nq, dp, 1, nkp, qr, ldq, dk, j->D, 1);
            }
        }
        if (want_k)
            store_rows(j->dk, kv_at(j, b, k0, kh, j->D), j->Hkv * j->D, nk, j->D, dk, j->D,
                       j->scale);
        if (want_v)
            store_rows(j->dv, kv_at(j, b, k0, kh, j->Dv), j->Hkv * j->Dv, nk, j->Dv, dv, j->Dv,
                       1.0f);
    }
}

/* Pass 2: dq of one query block of one head, over the key blocks it sees. */
static void dq_tasks(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const attn_job *j = ctx;
    _Alignas(64) float qt[D_MAX * BQ], gt[D_MAX * BQ], dqt[D_MAX * BQ];
    _Alignas(64) float st[BK * BQ], dpt[BK * BQ], kbuf[BK * D_MAX], vbuf[BK * D_MAX];
    _Alignas(64) float lse[BQ], di[BQ], f[BQ];
    for (int64_t task = begin; task < end; task++) {
        const int64_t bh = task / j->nqb, qb = zigzag(task % j->nqb, j->nqb);
        const int64_t b = bh / j->Hq, h = bh % j->Hq, kh = h / j->G;
        const int64_t t0 = qb * BQ, nq = j->T - t0 < BQ ? j->T - t0 : BQ, nqp = pad16(nq);
        load_transposed(j->q, q_at(j, b, t0, h, j->D), j->Hq * j->D, nq, j->D, j->scale, qt,
                        nqp, kbuf);
        load_transposed(j->go, q_at(j, b, t0, h, j->Dv), j->Hq * j->Dv, nq, j->Dv, 1.0f, gt,
                        nqp, kbuf);
        memset(dqt, 0, (size_t)(j->D * nqp) * sizeof *dqt);
        for (int64_t i = 0; i < nqp; i++) {
            const int in = i < nq;
            lse[i] = in ? j->lse_in[lse_at(j, b, h, t0 + i)] : 0.0f;
            di[i] = in ? j->di[lse_at(j, b, h, t0 + i)] : 0.0f;
            f[i] = j->scale;
        }
        int64_t klo, khi, unused;
        key_range(j, t0 + j->off, &klo, &unused);
        key_range(j, t0 + nq - 1 + j->off, &unused, &khi);
        for (int64_t k0 = klo / BK * BK; k0 < khi; k0 += BK) {
            const int64_t nk = j->S - k0 < BK ? j->S - k0 : BK;
            const int kind = block_kind(j, b, t0, nq, k0, nk);
            if (kind == BLOCK_NONE)
                continue;
            int64_t ldk, ldv;
            const float *kr = rows_f32(j->k, kv_at(j, b, k0, kh, j->D), j->Hkv * j->D, nk, j->D,
                                       kbuf, &ldk);
            const float *vr = rows_f32(j->v, kv_at(j, b, k0, kh, j->Dv), j->Hkv * j->Dv, nk,
                                       j->Dv, vbuf, &ldv);
            kt__attn_gemm(nk, nqp, j->D, kr, ldk, 1, qt, nqp, st, nqp, 0);
            if (j->cap > 0.0f)
                kt__attn_softcap(nk, nqp, st, nqp, j->cap);
            if (kind == BLOCK_PARTIAL)
                mask_block(j, b, t0, nq, k0, nk, st, nqp, 1);
            kt__attn_gemm(nk, nqp, j->Dv, vr, ldv, 1, gt, nqp, dpt, nqp, 0);
            kt__attn_probs_grad(nk, nqp, st, nqp, dpt, nqp, lse, di, 1, j->cap);
            kt__attn_gemm(j->D, nqp, nk, kr, 1, ldk, dpt, nqp, dqt, nqp, 1); /* dq^T += k^T ds^T */
        }
        store_transposed(j->dq, q_at(j, b, t0, h, j->D), j->Hq * j->D, nq, j->D, dqt, nqp, f);
    }
}

/* The fused backward: one task per (batch, KV head) owns that head's dk and dv (summed in
 * acc_k / acc_v, rows ld_acc apart: the f32 gradients themselves, or f32 scratch) and walks
 * its query heads and blocks; each query block's dq is finished over its key blocks. Five
 * products a block pair, all on untransposed blocks or ones transposed once per query
 * block: s^T = k q^T, dp^T = v dO^T, dv += p^T dO, dk += ds^T q, dq^T += k^T ds^T. */
static void fused_tasks(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const attn_job *j = ctx;
    _Alignas(64) float qt[D_MAX * BQ], gt[D_MAX * BQ], dqt[D_MAX * BQ];
    _Alignas(64) float st[BK * BQ], dpt[BK * BQ], kbuf[BK * D_MAX], vbuf[BK * D_MAX];
    _Alignas(64) float qbuf[BQ * D_MAX], gbuf[BQ * D_MAX];
    _Alignas(64) float lse[BQ], di[BQ], f[BQ];
    for (int64_t task = begin; task < end; task++) {
        const int64_t b = task / j->Hkv, kh = task % j->Hkv;
        float *acc_k = j->acc_k ? j->acc_k + kv_at(j, b, 0, kh, j->D) : NULL;
        float *acc_v = j->acc_v ? j->acc_v + kv_at(j, b, 0, kh, j->Dv) : NULL;
        const int64_t ldak = j->Hkv * j->D, ldav = j->Hkv * j->Dv;
        for (int64_t s = 0; s < j->S; s++) {
            if (acc_k)
                memset(acc_k + s * ldak, 0, (size_t)j->D * sizeof *acc_k);
            if (acc_v)
                memset(acc_v + s * ldav, 0, (size_t)j->Dv * sizeof *acc_v);
        }
        for (int64_t hg = 0; hg < j->G; hg++) {
            const int64_t h = kh * j->G + hg;
            for (int64_t qb = 0; qb < j->nqb; qb++) {
                const int64_t t0 = qb * BQ, nq = j->T - t0 < BQ ? j->T - t0 : BQ;
                const int64_t nqp = pad16(nq);
                int64_t klo, khi, unused;
                key_range(j, t0 + j->off, &klo, &unused);
                key_range(j, t0 + nq - 1 + j->off, &unused, &khi);
                if (khi <= klo && !j->dq)
                    continue;
                int64_t ldq, ldg;
                const float *qr = rows_packed(j->q, q_at(j, b, t0, h, j->D), j->Hq * j->D, nq,
                                              j->D, qbuf, &ldq);
                const float *gr = rows_packed(j->go, q_at(j, b, t0, h, j->Dv), j->Hq * j->Dv,
                                              nq, j->Dv, gbuf, &ldg);
                kt__attn_transpose(nq, j->D, qr, ldq, j->scale, qt, nqp);
                kt__attn_transpose(nq, j->Dv, gr, ldg, 1.0f, gt, nqp);
                memset(dqt, 0, (size_t)(j->D * nqp) * sizeof *dqt);
                for (int64_t i = 0; i < nqp; i++) {
                    const int in = i < nq;
                    lse[i] = in ? j->lse_in[lse_at(j, b, h, t0 + i)] : 0.0f;
                    di[i] = in ? j->di[lse_at(j, b, h, t0 + i)] : 0.0f;
                    f[i] = j->scale;
                }
                for (int64_t k0 = klo / BK * BK; k0 < khi; k0 += BK) {
                    const int64_t nk = j->S - k0 < BK ? j->S - k0 : BK;
                    const int kind = block_kind(j, b, t0, nq, k0, nk);
                    if (kind == BLOCK_NONE)
                        continue;
                    int64_t ldk, ldv;
                    const float *kr = rows_f32(j->k, kv_at(j, b, k0, kh, j->D), j->Hkv * j->D,
                                               nk, j->D, kbuf, &ldk);
                    const float *vr = rows_f32(j->v, kv_at(j, b, k0, kh, j->Dv),
                                               j->Hkv * j->Dv, nk, j->Dv, vbuf, &ldv);
                    kt__attn_gemm(nk, nqp, j->D, kr, ldk, 1, qt, nqp, st, nqp, 0);
                    if (j->cap > 0.0f)
                        kt__attn_softcap(nk, nqp, st, nqp, j->cap);
                    if (kind == BLOCK_PARTIAL)
                        mask_block(j, b, t0, nq, k0, nk, st, nqp, 1);
                    kt__attn_gemm(nk, nqp, j->Dv, vr, ldv, 1, gt, nqp, dpt, nqp, 0);
                    kt__attn_probs_grad(nk, nqp, st, nqp, dpt, nqp, lse, di, 1, j->cap);
                    if (acc_v) /* dv += p^T dO (rows of p^T: keys) */
                        kt__attn_gemm(nk, j->Dv, nq, st, nqp, 1, gr, ldg, acc_v + k0 * ldav,
                                      ldav, 1);
                    if (acc_k) /* dk += ds^T q (scale at the end) */
                        kt__attn_gemm(nk, j->D, nq, dpt, nqp, 1, qr, ldq, acc_k + k0 * ldak,
                                      ldak, 1);
                    if (j->dq)
                        kt__attn_gemm(j->D, nqp, nk, kr, 1, ldk, dpt, nqp, dqt, nqp, 1);
                }
                if (j->dq)
                    store_transposed(j->dq, q_at(j, b, t0, h, j->D), j->Hq * j->D, nq, j->D,
                                     dqt, nqp, f);
            }
        }
        /* dk = scale * sum (rounded once for bf16/f16, from the f32 sums in scratch) */
        for (int64_t s = 0; s < j->S; s++) {
            if (acc_k)
                store_rows(j->dk, kv_at(j, b, s, kh, j->D), ldak, 1, j->D, acc_k + s * ldak,
                           ldak, j->scale);
            if (acc_v && j->dv->dtype != KT_F32)
                store_rows(j->dv, kv_at(j, b, s, kh, j->Dv), ldav, 1, j->Dv, acc_v + s * ldav,
                           ldav, 1.0f);
        }
    }
}

static size_t scratch_bwd_attention(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)at, (void)n;
    const size_t rows = (size_t)(in[0].shape[0] * in[0].shape[1] * in[0].shape[2]);
    const kt_tensor *k = &in[1], *v = &in[2];
    /* the fused backward's f32 sums of dk and dv, for bf16/f16 gradients */
    const size_t sums = in[0].dtype == KT_F32 ? 0
                        : (size_t)(kt_tensor_numel(k) + kt_tensor_numel(v)) * sizeof(float);
    return (rows + 15) / 16 * 16 * sizeof(float) /* di */ + sums;
}

static kt_status bwd_attention(const kt__op_call *c)
{
    attn_job j;
    job_init(&j, c->attrs, c->in, c->n_in);
    j.o = &c->out[0];
    j.lse_in = c->out[1].data;
    j.go = &c->gout[0];
    j.glse = &c->gout[1];
    j.di = c->scratch;
    j.dq = c->gin[0].data ? &c->gin[0] : NULL;
    j.dk = c->gin[1].data ? &c->gin[1] : NULL;
    j.dv = c->gin[2].data ? &c->gin[2] : NULL;
    const int64_t rows = j.B * j.T * j.Hq;
    kt_parallel_for(c->pool, rows, kt__rows_grain(j.Dv), di_rows, &j);
    const int64_t pairs = j.B * j.Hkv, threads = kt_threadpool_size(c->pool);
    if (pairs % threads == 0 || pairs >= 4 * threads) {
        /* the (batch, KV head) pairs share out evenly: the fused backward */
        float *sums = (float *)c->scratch + (rows + 15) / 16 * 16;
        if (j.dk)
            j.acc_k = j.dk->dtype == KT_F32 ? j.dk->data : sums;
        if (j.dv)
            j.acc_v = j.dv->dtype == KT_F32 ? j.dv->data : sums + kt_tensor_numel(j.k);
        kt_parallel_for(c->pool, j.B * j.Hkv, 1, fused_tasks, &j);
        return KT_OK;
    }
    if (j.dk || j.dv)
        kt_parallel_for(c->pool, j.B * j.Hkv * j.nkb, 1, dkv_tasks, &j);
    if (j.dq)
        kt_parallel_for(c->pool, j.B * j.Hq * j.nqb, 1, dq_tasks, &j);
    return KT_OK;
}

/* ---- the row ------------------------------------------------------------------------------- */

/* Query-key pairs a query sees (segments aside, which only the data knows). */
static double visible_pairs(const attn_job *j)
{
    double n = 0.0;
    for (int64_t t = 0; t < j->T; t++) {
        int64_t lo, hi;
        key_range(j, t + j->off, &lo, &hi);
        n += (double)(hi - lo);
    }
    return n;
}

/* q k^T and p v: 2 (D + Dv) for each pair a query sees, per batch and head; the softmax's
 * exps are not counted */
static double flops_attention(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    attn_job j;
    job_init(&j, at, in, n);
    return 2.0 * (double)(j.D + j.Dv) * visible_pairs(&j) * (double)(j.B * j.Hq);
}

static const kt__attr_desc attention_attrs[] = {
    KT__A_FLOAT("scale", attn_scale, 0.0, 0.0, FLT_MAX, "multiplies q.k (0: 1/sqrt(D))"),
    KT__A_BOOL("causal", attn_causal, 0, "query t sees key j only if j <= S-T+t"),
    KT__A_I64("window", attn_window, 0, 0, INT64_MAX,
              "and only if S-T+t - j < window (0: no limit)"),
    KT__A_FLOAT("softcap", attn_softcap, 0.0, 0.0, FLT_MAX,
                "scores become softcap tanh(s / softcap) (0: not capped)"),
};

const kt__op_desc kt__op_attention = {
    .name = "attention", .min_in = 3, .max_in = 4, .n_out = 2,
    .bwd_reads_in = 0xfu, .bwd_reads_out = 3u, .no_grad_in = 1u << 3,
    .infer = infer_attention, .scratch_bwd = scratch_bwd_attention, .flops = flops_attention,
    .forward = fwd_attention, .backward = bwd_attention, KT__ATTR_LIST(attention_attrs)};
