/* moe: the CPU MoE layer as a graph op. The layer object (kt/moe.h) holds the expert
 * weights and what its backward needs, so the op only checks shapes and hands the tensors
 * to the layer the session bound as `attrs.binding`. */
#include "kt/moe.h"
#include "ops/op_desc.h"
#include "ops/op_util.h"

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
    if (at->binding < 0)
        return kt__error(KT_EINVAL, "moe: binding %d is negative", at->binding);
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

static kt_status fwd_moe(const kt__op_call *c)
{
    kt_moe *m = NULL;
    KT__TRY(layer_of(c, &m));
    return kt_moe_forward(m, &c->in[0], &c->in[1], &c->in[2], &c->out_w[0]);
}

static kt_status bwd_moe(const kt__op_call *c)
{
    kt_moe *m = NULL;
    KT__TRY(layer_of(c, &m));
    return kt_moe_backward(m, &c->gout[0], &c->gin[0], &c->gin[2], 1.0f);
}

const kt__op_desc kt__op_moe = {
    .name = "moe", .min_in = 3, .max_in = 3, .n_out = 1, .no_grad_in = 2u, .must_save = 1,
    .infer = infer_moe, .flops = flops_moe, .forward = fwd_moe, .backward = bwd_moe};
