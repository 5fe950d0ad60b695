/* moe: the CPU MoE layer as a graph op. The layer object (kt/moe.h) holds the expert
 * weights and what its backward needs, so the op only checks shapes and hands the tensors
 * to the layer the session bound as `attrs.binding`. */
#include <string.h>

#include "kt/comm.h"
#include "kt/moe.h"
#include "lib/ops/moe_dist.h"
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

/* Several ranks: rank 0 holding the experts (moe_rank0.c) or expert parallelism (moe_ep.c). */
static size_t comm_scratch_moe(const kt_op_attrs *at, const kt_tensor *in, int n, int world)
{
    (void)n, (void)at;
    if (world <= 1)
        return 0;
    /* either mode: the session may choose for every op (kt_session_options.moe_parallel) */
    size_t ep = kt__moe_ep_scratch(in, world), rank0 = kt__moe_rank0_scratch(in, world);
    return ep > rank0 ? ep : rank0;
}

static int distributed(const kt__op_call *c) { return c->comm != NULL && kt_comm_size(c->comm) > 1; }

static kt_status fwd_moe(const kt__op_call *c)
{
    if (distributed(c))
        return kt__moe_mode(c) == KT_MOE_PARALLEL_EP ? kt__moe_ep_forward(c)
                                                            : kt__moe_rank0_forward(c);
    kt_moe *m = NULL;
    KT__TRY(layer_of(c, &m));
    return kt_moe_forward(m, &c->in[0], &c->in[1], &c->in[2], &c->out_w[0]);
}

static kt_status bwd_moe(const kt__op_call *c)
{
    if (distributed(c))
        return kt__moe_mode(c) == KT_MOE_PARALLEL_EP ? kt__moe_ep_backward(c)
                                                            : kt__moe_rank0_backward(c);
    kt_moe *m = NULL;
    KT__TRY(layer_of(c, &m));
    return kt_moe_backward(m, &c->gout[0], &c->gin[0], &c->gin[2], 1.0f);
}

/* kt_moe_names order */
static const char *const moe_name_schemes[] = {"moe", "hf", "mixtral"};
/* kt_moe_parallel order */
static const char *const moe_parallel_modes[] = {"rank0", "ep"};
_Static_assert(sizeof(kt_moe_parallel) == sizeof(int), "an enum attribute is stored as an int");
_Static_assert(sizeof(kt_moe_names) == sizeof(int), "an enum attribute is stored as an int");

static const kt__attr_desc moe_attrs[] = {
    KT__A_INT("layer", binding, 0, 0, KT_MOE_MAX_LAYERS - 1,
              "which of the session's MoE layers runs it: the model's layer index"),
    KT__A_I64("intermediate", moe_intermediate, 0, 0, (int64_t)1 << 30,
              "the experts' intermediate size (0: whoever creates the layers says)"),
    KT__A_ENUM("names", moe_names, KT_MOE_NAMES_MOE, moe_name_schemes,
               "the layer's tensor names in checkpoints (kt_moe_names)"),
    KT__A_ENUM("parallel", moe_parallel, KT_MOE_PARALLEL_RANK0, moe_parallel_modes,
               "several ranks: rank0 (rank 0 holds every expert) or ep (each rank holds its "
               "share: layers of top_k 1 with the model's expert ids; docs/parallel.md)"),
};

const kt__op_desc kt__op_moe = {
    .name = "moe", .min_in = 3, .max_in = 3, .n_out = 1, .no_grad_in = 2u, .must_save = 1,
    .infer = infer_moe, .flops = flops_moe, .comm_scratch = comm_scratch_moe,
    .forward = fwd_moe, .backward = bwd_moe, .state = &kt__moe_state,
    KT__ATTR_LIST(moe_attrs)};
