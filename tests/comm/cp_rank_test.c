/* Multi-rank graph ops, run as one rank under kt-launch: every rank builds the same model on
 * its shard and compares with the single-rank result on the whole sequence (or batch), which
 * it computes itself on a one-rank session.
 *
 *   cp_rank_test halo MODE   causal conv on a sequence sharded over the ranks: outputs,
 *                            loss and gradients equal the unsharded ones (kernel 1..5,
 *                            left-only and both sides); MODE is p2p or allgather
 *   cp_rank_test moe         distributed MoE: rank 0 owns the experts; outputs and gradients
 *                            equal one rank running the concatenated batch
 *   cp_rank_test moe_fail    rank 0's layer fails inside the forward (NaN in an expert with
 *                            check_finite): every rank returns the error, with rank 0's message,
 *                            within the deadline, instead of waiting for the scatter
 *   cp_rank_test moe_fail_bwd  the same with the failure inside the backward
 *
 * Prints "PASS rank r" or "FAIL rank r: why" and exits 0/1. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kt/kt.h>

#include "tests/comm/rank_check.h"

/* f32 or bf16 (rounded) values */
static void fill(kt_tensor *t, uint64_t seed, int64_t offset)
{
    for (int64_t i = 0; i < kt_tensor_numel(t); i++) {
        const float v = rank_value_at(seed, i + offset);
        if (t->dtype == KT_BF16)
            ((uint16_t *)t->data)[i] = kt_f32_to_bf16_1(v);
        else
            ((float *)t->data)[i] = v;
    }
}

/* A copy of an f32 or bf16 tensor's values as f32 (bf16 widened exactly). */
static float *copy_f32(const kt_tensor *t)
{
    const int64_t n = kt_tensor_numel(t);
    float *v = malloc((size_t)(n > 0 ? n : 1) * sizeof *v);
    if (v == NULL)
        rank_fail("out of memory");
    if (t->dtype == KT_BF16)
        kt_bf16_to_f32(v, t->data, (size_t)n);
    else
        memcpy(v, t->data, (size_t)n * sizeof *v);
    return v;
}

static double rel_err(const float *a, const float *b, int64_t n)
{
    double scale = 1e-12, err = 0;
    for (int64_t i = 0; i < n; i++)
        scale = fmax(scale, fabs((double)b[i]));
    for (int64_t i = 0; i < n; i++)
        err = fmax(err, fabs((double)a[i] - (double)b[i]));
    return err / scale;
}

/* ---- halo: x -> mul(x, s) -> halo -> conv1d valid -> cross-entropy ----------------------
 * f32: s and w trained (forward, backward, the gradients compared). bf16: a frozen model (a
 * graph's trainable parameters are f32 and an op takes one dtype, so bf16 runs forward only):
 * x, s and w bf16, the halo's slabs carry bf16 frames, the outputs are compared. */

enum { SHARD_T = 12, C = 6, CLASSES = 6 };

static kt_program *halo_model(int64_t t, int kernel, int64_t left, int64_t right, int sharded,
                              kt_halo_mode mode, kt_dtype dt)
{
    kt_graph *g;
    kt_value x, y, s, w, h, out, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", dt, 2, (int64_t[]){t, C}, &x));
    if (dt == KT_F32) {
        OK(kt_graph_input(g, "y", KT_I32, 1, (int64_t[]){t}, &y));
        OK(kt_graph_param(g, "s", dt, 1, (int64_t[]){C}, kt_init_zeros(), &s));
        OK(kt_graph_param(g, "w", dt, 3, (int64_t[]){C, kernel, C}, kt_init_zeros(), &w));
    } else {
        OK(kt_graph_const_param(g, "s", dt, 1, (int64_t[]){C}, kt_init_zeros(), &s));
        OK(kt_graph_const_param(g, "w", dt, 3, (int64_t[]){C, kernel, C}, kt_init_zeros(), &w));
    }
    OK(kt_graph_op(g, "scale", KT_OP_MUL, NULL, (kt_value[]){x, s}, 2, &h));
    if (sharded) {
        kt_op_attrs ha = kt_op_defaults(KT_OP_HALO);
        ha.dim = 0;
        ha.halo_left = left;
        ha.halo_right = right;
        ha.halo_mode = mode;
        OK(kt_graph_op(g, "halo", KT_OP_HALO, &ha, &h, 1, &h));
        kt_op_attrs ca = kt_op_defaults(KT_OP_CONV1D);
        ca.conv_mode = KT_CONV_VALID;
        OK(kt_graph_op(g, "conv", KT_OP_CONV1D, &ca, (kt_value[]){h, w}, 2, &out));
    } else {
        /* the unsharded reference pads the whole sequence the same way */
        kt_op_attrs ca = kt_op_defaults(KT_OP_CONV1D);
        ca.conv_mode = right == 0 ? KT_CONV_CAUSAL : KT_CONV_SAME;
        OK(kt_graph_op(g, "conv", KT_OP_CONV1D, &ca, (kt_value[]){h, w}, 2, &out));
    }
    OK(kt_graph_output(g, out, "out"));
    if (dt == KT_F32) { /* the frozen bf16 model has no loss: a forward-only program */
        kt_op_attrs ce = kt_op_defaults(KT_OP_CROSS_ENTROPY);
        ce.ignore_index = -100;
        OK(kt_graph_op(g, "loss", KT_OP_CROSS_ENTROPY, &ce, (kt_value[]){out, y}, 2, &loss));
        OK(kt_graph_set_loss(g, loss));
    }
    kt_program *p;
    OK(kt_compile(g, NULL, &p));
    kt_graph_destroy(g);
    return p;
}

typedef struct result {
    float *out, *gs, *gw;
    float loss;
} result;

static void run_halo(kt_program *p, kt_comm *comm, int64_t t, int64_t offset, int kernel,
                     result *r)
{
    kt_session *s;
    kt_session_options so = {.threads = 1, .comm = comm,
                             .optimizer = {.kind = KT_OPTIM_NONE}};
    OK(kt_session_create(p, &so, &s));
    kt_tensor x, y, ps, pw, out, gs, gw;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "x", &x));
    OK(kt_session_tensor(s, KT_ROLE_PARAM, "s", &ps));
    OK(kt_session_tensor(s, KT_ROLE_PARAM, "w", &pw));
    fill(&x, 1, offset * C);
    if (x.dtype == KT_F32) {
        OK(kt_session_tensor(s, KT_ROLE_INPUT, "y", &y));
        for (int64_t i = 0; i < t; i++)
            ((int32_t *)y.data)[i] = (int32_t)((i + offset) * 7 % CLASSES);
    }
    fill(&ps, 2, 0);
    fill(&pw, 3 + (uint64_t)kernel, 0);
    OK(kt_session_forward(s));
    OK(kt_session_tensor(s, KT_ROLE_OUTPUT, "out", &out));
    r->out = copy_f32(&out);
    r->gs = r->gw = NULL;
    r->loss = 0;
    if (x.dtype == KT_F32) {
        OK(kt_session_backward(s));
        OK(kt_session_step(s)); /* no update: only averages gradients and the loss over the ranks */
        OK(kt_session_tensor(s, KT_ROLE_GRAD, "s", &gs));
        OK(kt_session_tensor(s, KT_ROLE_GRAD, "w", &gw));
        r->gs = copy_f32(&gs);
        r->gw = copy_f32(&gw);
        r->loss = kt_session_loss(s);
    }
    kt_session_destroy(s);
}

static void result_free(result *r) { free(r->out), free(r->gs), free(r->gw); }

/* bf16: the sharded output must equal the whole run's bit for bit (the halo moves frames
 * unchanged, and the conv sums each output in the same order either way). */
static void scenario_halo(kt_comm *comm, kt_halo_mode mode, kt_dtype dt)
{
    const double bound = dt == KT_BF16 ? 0 : 1e-5;
    int world = kt_comm_size(comm), rank = kt_comm_rank(comm);
    int cases = 0;
    for (int kernel = 1; kernel <= 5; kernel++) {
        for (int both = 0; both <= 1; both++) {
            int64_t left = both ? kernel / 2 : kernel - 1, right = both ? kernel - 1 - kernel / 2 : 0;
            kt_program *sharded = halo_model(SHARD_T, kernel, left, right, 1, mode, dt);
            kt_program *whole = halo_model(SHARD_T * world, kernel, left, right, 0, mode, dt);
            result a, b;
            run_halo(sharded, comm, SHARD_T, (int64_t)rank * SHARD_T, kernel, &a);
            run_halo(whole, NULL, SHARD_T * world, 0, kernel, &b);
            /* this rank's rows of the whole sequence's output */
            double e_out = rel_err(a.out, b.out + (int64_t)rank * SHARD_T * CLASSES,
                                   SHARD_T * CLASSES);
            double e_s = 0, e_w = 0, e_l = 0;
            if (dt == KT_F32) {
                e_s = rel_err(a.gs, b.gs, C), e_w = rel_err(a.gw, b.gw, C * kernel * C);
                e_l = fabs((double)a.loss - (double)b.loss) / fmax(fabs((double)b.loss), 1e-12);
            }
            if (e_out > bound || e_s > bound || e_w > bound || e_l > bound)
                rank_fail("halo %s %s K=%d %s: relative errors out %.3g, grad s %.3g, grad w %.3g, "
                     "loss %.3g (bound %g)",
                     mode == KT_HALO_P2P ? "p2p" : "allgather", kt_dtype_name(dt), kernel,
                     both ? "both sides" : "causal", e_out, e_s, e_w, e_l, bound);
            result_free(&a);
            result_free(&b);
            kt_program_destroy(sharded);
            kt_program_destroy(whole);
            cases++;
        }
    }
    printf("PASS rank %d: halo %s %s (%s), %d cases over %d ranks\n", rank,
           mode == KT_HALO_P2P ? "p2p" : "allgather", kt_dtype_name(dt),
           dt == KT_F32 ? "forward and backward" : "frozen, forward, bitwise", cases, world);
}

/* ---- distributed MoE ---------------------------------------------------------------------- */

enum { MT = 5, MH = 16, MI = 12, ME = 6, MK = 2 };

static kt_moe *make_layer(int64_t max_tokens)
{
    kt_moe_config c = {.n_experts = ME, .hidden = MH, .intermediate = MI, .top_k = MK,
                       .max_tokens = max_tokens, .weight_dtype = KT_F32, .act_dtype = KT_F32,
                       .mode = KT_MOE_FULL, .keep_activations = 1, .name = "dist"};
    kt_moe *m;
    OK(kt_moe_create(&c, NULL, &m));
    for (int64_t e = 0; e < ME; e++)
        for (int p = 0; p < 3; p++) {
            kt_tensor w;
            OK(kt_moe_weight(m, e, (kt_moe_proj)p, &w));
            fill(&w, 100 + (uint64_t)(e * 3 + p), 0);
        }
    return m;
}

static kt_program *moe_model(int64_t t)
{
    kt_graph *g;
    kt_value x, y, r, logits, out[2], m, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, (int64_t[]){t, MH}, &x));
    OK(kt_graph_input(g, "y", KT_I32, 1, (int64_t[]){t}, &y));
    OK(kt_graph_param(g, "router", KT_F32, 2, (int64_t[]){MH, ME}, kt_init_zeros(), &r));
    OK(kt_graph_op(g, "route", KT_OP_MATMUL, NULL, (kt_value[]){x, r}, 2, &logits));
    kt_op_attrs ra = kt_op_defaults(KT_OP_TOPK_ROUTER);
    ra.k = MK;
    ra.norm_topk = 1;
    OK(kt_graph_op(g, "topk", KT_OP_TOPK_ROUTER, &ra, &logits, 1, out));
    OK(kt_graph_op(g, "moe", KT_OP_MOE, NULL, (kt_value[]){x, out[0], out[1]}, 3, &m));
    kt_op_attrs ce = kt_op_defaults(KT_OP_CROSS_ENTROPY);
    ce.ignore_index = -100;
    OK(kt_graph_op(g, "loss", KT_OP_CROSS_ENTROPY, &ce, (kt_value[]){m, y}, 2, &loss));
    OK(kt_graph_output(g, m, "m"));
    OK(kt_graph_set_loss(g, loss));
    kt_program *p;
    OK(kt_compile(g, NULL, &p));
    kt_graph_destroy(g);
    return p;
}

static void run_moe(kt_program *p, kt_comm *comm, kt_moe *layer, int64_t t, int64_t offset,
                    float *out, float *grad_router, float *loss)
{
    kt_session *s;
    kt_session_options so = {.threads = 1, .comm = comm, .moe_layers = layer ? &layer : NULL,
                             .n_moe_layers = layer ? 1 : 0,
                             .optimizer = {.kind = KT_OPTIM_NONE}};
    OK(kt_session_create(p, &so, &s));
    kt_tensor x, y, r, m, gr;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "x", &x));
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "y", &y));
    OK(kt_session_tensor(s, KT_ROLE_PARAM, "router", &r));
    fill(&x, 7, offset * MH);
    for (int64_t i = 0; i < t; i++)
        ((int32_t *)y.data)[i] = (int32_t)((i + offset) * 5 % MH);
    fill(&r, 8, 0);
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));
    OK(kt_session_step(s));
    OK(kt_session_tensor(s, KT_ROLE_OUTPUT, "m", &m));
    OK(kt_session_tensor(s, KT_ROLE_GRAD, "router", &gr));
    memcpy(out, m.data, kt_tensor_nbytes(&m));
    memcpy(grad_router, gr.data, kt_tensor_nbytes(&gr));
    *loss = kt_session_loss(s);
    kt_session_destroy(s);
}

static void scenario_moe(kt_comm *comm)
{
    int world = kt_comm_size(comm), rank = kt_comm_rank(comm);
    kt_moe *layer = rank == 0 ? make_layer(MT * world) : NULL, *whole_layer = make_layer(MT * world);
    kt_program *p = moe_model(MT), *whole = moe_model(MT * world);
    float *out = malloc(sizeof(float) * MT * MH), *ref = malloc(sizeof(float) * MT * world * MH);
    float gr[MH * ME], gref[MH * ME], loss, lref;
    run_moe(p, comm, layer, MT, (int64_t)rank * MT, out, gr, &loss);
    run_moe(whole, NULL, whole_layer, MT * world, 0, ref, gref, &lref);
    double e_out = rel_err(out, ref + (int64_t)rank * MT * MH, MT * MH);
    double e_g = rel_err(gr, gref, MH * ME);
    double e_l = fabs((double)loss - (double)lref) / fmax(fabs((double)lref), 1e-12);
    if (e_out > 1e-5 || e_g > 1e-5 || e_l > 1e-5)
        rank_fail("distributed moe: relative errors out %.3g, grad router %.3g, loss %.3g", e_out,
             e_g, e_l);
    if (rank == 0) {
        /* the experts' weight gradients: each rank's loss is the mean over its own tokens, so
         * its output gradients are world times the whole batch's; the 1/world scale of the
         * distributed layer brings them back to the single-rank gradients (data-parallel
         * averaging) */
        kt_tensor a, b;
        OK(kt_moe_weight_grad(layer, 0, KT_MOE_UP, &a));
        OK(kt_moe_weight_grad(whole_layer, 0, KT_MOE_UP, &b));
        double e_w = rel_err(a.data, b.data, kt_tensor_numel(&a));
        if (e_w > 1e-5)
            rank_fail("distributed moe: expert weight gradient differs by %.3g", e_w);
    }
    free(out), free(ref);
    kt_program_destroy(p), kt_program_destroy(whole);
    kt_moe_destroy(layer), kt_moe_destroy(whole_layer);
    printf("PASS rank %d: distributed moe over %d ranks\n", rank, world);
}

/* Rank 0's layer fails (a NaN weight, check_finite on), inside the forward (a NaN down weight
 * from the start) or inside the backward (a NaN gate weight set after a good forward): every
 * rank gets rank 0's error, within the deadline, instead of waiting for the scatter. */
static void scenario_moe_fail(kt_comm *comm, int in_backward)
{
    int world = kt_comm_size(comm), rank = kt_comm_rank(comm);
    kt_moe *layer = NULL;
    if (rank == 0) {
        kt_moe_config c = {.n_experts = ME, .hidden = MH, .intermediate = MI, .top_k = MK,
                           .max_tokens = MT * world, .weight_dtype = KT_F32,
                           .act_dtype = KT_F32, .mode = KT_MOE_FROZEN, .keep_activations = 1,
                           .check_finite = 1, .name = "poisoned"};
        OK(kt_moe_create(&c, NULL, &layer));
        for (int64_t e = 0; e < ME; e++)
            for (int p = 0; p < 3; p++) {
                kt_tensor w;
                OK(kt_moe_weight(layer, e, (kt_moe_proj)p, &w));
                fill(&w, 100 + (uint64_t)(e * 3 + p), 0);
                if (p == KT_MOE_DOWN && !in_backward)
                    ((float *)w.data)[0] = NAN; /* every expert's output turns NaN */
            }
        OK(kt_moe_cache_enable(layer, 1));
    }
    kt_program *p = moe_model(MT);
    kt_session *s;
    kt_session_options so = {.threads = 1, .comm = comm, .moe_layers = layer ? &layer : NULL,
                             .n_moe_layers = layer ? 1 : 0};
    OK(kt_session_create(p, &so, &s));
    kt_tensor x, y, r;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "x", &x));
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "y", &y));
    OK(kt_session_tensor(s, KT_ROLE_PARAM, "router", &r));
    fill(&x, 7, (int64_t)rank * MT * MH);
    for (int64_t i = 0; i < MT; i++)
        ((int32_t *)y.data)[i] = (int32_t)(i * 5 % MH);
    fill(&r, 8, 0);
    kt_status st = kt_session_forward(s);
    const char *where = "forward";
    if (in_backward) {
        if (st != KT_OK)
            rank_fail("the forward failed before the injected backward failure: %s", kt_last_error());
        if (rank == 0)
            for (int64_t e = 0; e < ME; e++) {
                kt_tensor w;
                OK(kt_moe_weight(layer, e, KT_MOE_GATE, &w));
                for (int64_t i = 0; i < MI * MH; i++)
                    ((float *)w.data)[i] = NAN; /* every input gradient turns NaN */
            }
        st = kt_session_backward(s);
        where = "backward";
    }
    if (st == KT_OK)
        rank_fail("the %s succeeded although rank 0's layer produced NaN", where);
    if (strstr(kt_last_error(), "rank 0") == NULL || strstr(kt_last_error(), "poisoned") == NULL)
        rank_fail("error '%s' does not carry rank 0's message about layer 'poisoned'",
             kt_last_error());
    if (rank == 0 && kt_moe_cache_get_state(layer) != KT_MOE_CACHE_POISONED)
        rank_fail("rank 0's forward cache is not poisoned after the failure");
    printf("PASS rank %d: rank 0's MoE %s failure reached every rank: %s\n", rank, where,
           kt_last_error());
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_moe_destroy(layer);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: cp_rank_test halo p2p|allgather [bf16] | moe | moe_fail | "
                        "moe_fail_bwd\n");
        return 2;
    }
    kt_comm *comm;
    kt_status s = kt_comm_create_ucx(NULL, &comm);
    if (s != KT_OK)
        rank_fail("kt_comm_create_ucx: %s", kt_last_error());
    rank_id = kt_comm_rank(comm);
    if (strcmp(argv[1], "halo") == 0 && argc > 2)
        scenario_halo(comm, strcmp(argv[2], "allgather") == 0 ? KT_HALO_ALLGATHER : KT_HALO_P2P,
                      argc > 3 && strcmp(argv[3], "bf16") == 0 ? KT_BF16 : KT_F32);
    else if (strcmp(argv[1], "moe") == 0)
        scenario_moe(comm);
    else if (strcmp(argv[1], "moe_fail") == 0)
        scenario_moe_fail(comm, 0);
    else if (strcmp(argv[1], "moe_fail_bwd") == 0)
        scenario_moe_fail(comm, 1);
    else
        rank_fail("unknown scenario %s", argv[1]);
    fflush(stdout);
    kt_comm_destroy(comm);
    return 0;
}
