/* moe: the CPU MoE layer as a graph op. The layer object (kt/moe.h) holds the expert
 * weights and what its backward needs, so the op only checks shapes and hands the tensors
 * to the layer the session bound as `attrs.binding`. */
#include <string.h>

#include "kt/comm.h"
#include "kt/moe.h"
#include "lib/ops/map.h"
#include "lib/ops/op_desc.h"
#include "lib/ops/op_state.h"
#include "lib/ops/op_util.h"

extern const kt__op_state kt__moe_state; /* its session hooks: moe_state.c */

static kt_status infer_moe(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    (void)n;
    const kt_tensor *x = &in[0], *ids = &in[1], *w = &in[2];
    KT__TRY(kt__check_rank("moe", "x", x, 2, 2));
    KT__TRY(kt__check_float("moe", "x", x));
    KT__TRY(kt__check_rank("moe", "ids", ids, 2, 2));
    KT__TRY(kt__check_index("moe", "ids", ids));
    KT__TRY(kt__check_dim("moe", "ids", ids, 0, x->shape[0]));
    KT__TRY(kt__check_f32("moe", "weights", w));
    KT__TRY(kt__check_same_shape("moe", "weights", w, ids));
    if (at->binding < 0 || at->binding >= KT_MOE_MAX_LAYERS)
        return kt__error(KT_EINVAL, "moe: layer %d is outside 0 to %d", at->binding,
                         KT_MOE_MAX_LAYERS - 1);
    kt__like(&out[0], x);
    return KT_OK;
}

static double flops_moe(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)at, (void)n;
    /* three GEMMs of 2*H*I per (token, expert); I is the layer's, unknown here: count per H^2
     * so schedules can at least rank the op (the layer reports exact figures) */
    double h = (double)in[0].shape[1];
    return 6.0 * h * h * (double)kt_tensor_numel(&in[1]);
}

static kt_status layer_of(const kt__op_call *c, kt_moe **out)
{
    int b = c->attrs->binding;
    if (c->bindings == NULL || b >= c->n_bindings || c->bindings[b] == NULL)
        return kt__error(KT_EINVAL, "moe: no MoE layer is bound as binding %d (give the "
                         "session its layers in kt_session_options.moe_layers)", b);
    *out = c->bindings[b];
    return KT_OK;
}

/* ---- several ranks: rank 0 owns the experts ------------------------------------------------
 * Every rank runs the same program, so every rank has the same token count T: rank 0
 * gathers the W*T rows in rank order, runs the layer on them as one batch (the result equals
 * one rank running the concatenated batch), agrees on the status with everyone before the
 * scatter (so a failure on rank 0 reaches every rank instead of leaving them waiting), and
 * scatters the rows back. Weight gradients are the mean over the ranks, matching
 * data-parallel averaging. */

typedef struct dist {
    int world, rank;
    size_t *counts;
    kt_tensor x, ids, w, y, gy, gx, gw; /* [W*T, ...] on rank 0 */
} dist;

static size_t row_bytes(const kt_tensor *t)
{
    return (size_t)kt__dims_product(t, 1, t->ndim) * kt_dtype_size(t->dtype); /* T may be 0 */
}

static size_t comm_scratch_moe(const kt_op_attrs *at, const kt_tensor *in, int n, int world)
{
    (void)at, (void)n;
    if (world <= 1)
        return 0;
    size_t rows = (size_t)in[0].shape[0] * (size_t)world, a = 64;
    size_t bytes = ((sizeof(size_t) * (size_t)world + a - 1) / a) * a;
    size_t per_row = 4 * row_bytes(&in[0]) + row_bytes(&in[1]) + 2 * row_bytes(&in[2]);
    return bytes + rows * per_row + 8 * a;
}

static char *carve(char **cursor, size_t bytes)
{
    char *p = *cursor;
    *cursor += (bytes + 63) / 64 * 64;
    return p;
}

static kt_tensor rows_like(const kt_tensor *t, int world, char **cursor)
{
    kt_tensor r = *t;
    r.shape[0] *= world;
    (void)kt_tensor_init(&r, NULL, t->dtype, t->ndim, r.shape);
    r.data = carve(cursor, kt_tensor_nbytes(&r));
    return r;
}

static kt_status dist_setup(const kt__op_call *c, dist *d)
{
    d->world = kt_comm_size(c->comm);
    d->rank = kt_comm_rank(c->comm);
    if (c->comm_scratch == NULL)
        return kt__error(KT_EINVAL, "moe: no message buffers (run it in a session)");
    char *cursor = c->comm_scratch;
    d->counts = (size_t *)(void *)carve(&cursor, sizeof(size_t) * (size_t)d->world);
    d->x = rows_like(&c->in[0], d->world, &cursor);
    d->y = rows_like(&c->in[0], d->world, &cursor);
    d->gy = rows_like(&c->in[0], d->world, &cursor);
    d->gx = rows_like(&c->in[0], d->world, &cursor);
    d->ids = rows_like(&c->in[1], d->world, &cursor);
    d->w = rows_like(&c->in[2], d->world, &cursor);
    d->gw = rows_like(&c->in[2], d->world, &cursor);
    return KT_OK;
}

static kt_status gather_rows(const kt__op_call *c, dist *d, const kt_tensor *local, kt_tensor *all)
{
    for (int r = 0; r < d->world; r++)
        d->counts[r] = kt_tensor_nbytes(local);
    return kt_comm_gatherv(c->comm, local->data, d->counts, all->data, 0);
}

static kt_status scatter_rows(const kt__op_call *c, dist *d, const kt_tensor *all, kt_tensor *local)
{
    for (int r = 0; r < d->world; r++)
        d->counts[r] = kt_tensor_nbytes(local);
    return kt_comm_scatterv(c->comm, all->data, d->counts, local->data, 0);
}

static kt_status fwd_moe_dist(const kt__op_call *c)
{
    dist d;
    KT__TRY(dist_setup(c, &d));
    KT__TRY(gather_rows(c, &d, &c->in[0], &d.x));
    KT__TRY(gather_rows(c, &d, &c->in[1], &d.ids));
    KT__TRY(gather_rows(c, &d, &c->in[2], &d.w));
    kt_status st = KT_OK;
    if (d.rank == 0) {
        kt_moe *m = NULL;
        st = layer_of(c, &m);
        if (st == KT_OK)
            st = kt_moe_forward(m, &d.x, &d.ids, &d.w, &d.y);
    }
    KT__TRY(kt_comm_agree(c->comm, st));
    return scatter_rows(c, &d, &d.y, &c->out_w[0]);
}

/* t *= s in place, in t's dtype (arithmetic in f32).
 *
 * Each rank's loss is the mean over its own T tokens, so the output gradients gathered on
 * rank 0 are W times those of the mean loss over all W*T tokens, and the ranks' backward
 * expects input gradients of the same scale. Linear algebra does not care where the 1/W is
 * applied, but rounding does: a layer with bf16 weights rounds the output gradients to bf16,
 * and W*g rounds differently from g unless W is a power of two (with 3 ranks and bf16
 * experts, the first step's parameter gradients differed from one rank's by 6x more than
 * with this scaling; what remains comes from x itself rounding to bf16 after f32-level
 * differences upstream). So rank 0 divides the
 * gathered gradients by W, runs the layer's backward exactly as one rank would (weight
 * gradient scale 1: the mean over the ranks), and multiplies the input gradients it returns
 * by W (in f32 arithmetic, stored in the activation dtype: a bf16 grad_x is rounded once by
 * the layer and once more here). */
static void scale_rows(kt_threadpool *pool, kt_tensor *t, float s)
{
    const kt_op_attrs at = {.alpha = s};
    kt__map1(pool, t, t, kt__map_scale, &at); /* elementwise, so in place is safe */
}

static kt_status bwd_moe_dist(const kt__op_call *c)
{
    dist d;
    KT__TRY(dist_setup(c, &d));
    KT__TRY(gather_rows(c, &d, &c->gout[0], &d.gy));
    kt_status st = KT_OK;
    int want_x = c->gin[0].data != NULL, want_w = c->gin[2].data != NULL;
    if (d.rank == 0) {
        kt_moe *m = NULL;
        kt_tensor gx = d.gx, gw = d.gw;
        if (!want_x)
            gx.data = NULL;
        if (!want_w)
            gw.data = NULL;
        st = layer_of(c, &m);
        if (st == KT_OK) {
            /* the layer runs on the gradient of the mean loss over all ranks, the one a
             * single rank would see; see scale_rows */
            float w = (float)d.world;
            scale_rows(c->pool, &d.gy, 1.0f / w);
            st = kt_moe_backward(m, &d.gy, &gx, &gw, 1.0f);
            if (st == KT_OK && want_x)
                scale_rows(c->pool, &gx, w);
            if (st == KT_OK && want_w)
                scale_rows(c->pool, &gw, w);
        }
    }
    KT__TRY(kt_comm_agree(c->comm, st));
    if (want_x)
        KT__TRY(scatter_rows(c, &d, &d.gx, &c->gin[0]));
    if (want_w)
        KT__TRY(scatter_rows(c, &d, &d.gw, &c->gin[2]));
    return KT_OK;
}

static int distributed(const kt__op_call *c) { return c->comm != NULL && kt_comm_size(c->comm) > 1; }

static kt_status fwd_moe(const kt__op_call *c)
{
    if (distributed(c))
        return fwd_moe_dist(c);
    kt_moe *m = NULL;
    KT__TRY(layer_of(c, &m));
    return kt_moe_forward(m, &c->in[0], &c->in[1], &c->in[2], &c->out_w[0]);
}

static kt_status bwd_moe(const kt__op_call *c)
{
    if (distributed(c))
        return bwd_moe_dist(c);
    kt_moe *m = NULL;
    KT__TRY(layer_of(c, &m));
    return kt_moe_backward(m, &c->gout[0], &c->gin[0], &c->gin[2], 1.0f);
}

/* kt_moe_names order */
static const char *const moe_name_schemes[] = {"moe", "hf", "mixtral"};
_Static_assert(sizeof(kt_moe_names) == sizeof(int), "an enum attribute is stored as an int");

static const kt__attr_desc moe_attrs[] = {
    KT__A_INT("layer", binding, 0, 0, KT_MOE_MAX_LAYERS - 1,
              "which of the session's MoE layers runs it: the model's layer index"),
    KT__A_I64("intermediate", moe_intermediate, 0, 0, (int64_t)1 << 30,
              "the experts' intermediate size (0: whoever creates the layers says)"),
    KT__A_ENUM("names", moe_names, KT_MOE_NAMES_MOE, moe_name_schemes,
               "the layer's tensor names in checkpoints (kt_moe_names)"),
};

const kt__op_desc kt__op_moe = {
    .name = "moe", .min_in = 3, .max_in = 3, .n_out = 1, .no_grad_in = 2u, .must_save = 1,
    .infer = infer_moe, .flops = flops_moe, .comm_scratch = comm_scratch_moe,
    .forward = fwd_moe, .backward = bwd_moe, .state = &kt__moe_state,
    KT__ATTR_LIST(moe_attrs)};
