/* A second stateful op, written entirely in this test: `counter` (y = w * sum(x)) trains one
 * weight w of its own and keeps a running count of its forwards and the running sum of what
 * it saw. It takes the place of a public op's row through kt__op_override_for_test, so the
 * session, executor, step and session file serve it through its hooks alone: no runtime edit,
 * and the public op list carries no test op. Exercised through a session: forward, backward,
 * the optimizer step, poison and recovery, save, and load (with its dry-run check). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "lib/core/error.h"
#include "graph/runtime/session_internal.h"
#include "kt/kt.h"
#include "lib/ops/op_desc.h"
#include "lib/ops/op_state.h"
#include "tests/support/test_util.h"

/* The op whose row the test op borrows (one input, one output, like counter). */
#define HOST_OP KT_OP_SCALE

typedef struct counter_state {
    float w, gw;
    float stats[2]; /* forwards run, running sum of sum(x) */
    int backwards, poisoned;
} counter_state;

static int bound, unbound; /* binds and unbinds seen, to check the session pairs them */

/* ---- the op ------------------------------------------------------------------------------ */

static kt_status infer_counter(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    (void)at, (void)n;
    if (in[0].dtype != KT_F32 || in[0].ndim != 1)
        return kt__error(KT_EINVAL, "counter: x must be f32 [N]");
    return kt_tensor_init(&out[0], NULL, KT_F32, 1, (int64_t[]){1});
}

static float sum_of(const kt_tensor *t)
{
    float s = 0.0f;
    for (int64_t i = 0; i < kt_tensor_numel(t); i++)
        s += ((const float *)t->data)[i];
    return s;
}

static kt_status fwd_counter(const kt__op_call *c)
{
    counter_state *st = c->state;
    if (st == NULL)
        return kt__error(KT_EINVAL, "counter: no state (run it in a session)");
    float s = sum_of(&c->in[0]);
    ((float *)c->out_w[0].data)[0] = st->w * s;
    st->stats[0] += 1.0f;
    st->stats[1] += s;
    return KT_OK;
}

static kt_status bwd_counter(const kt__op_call *c)
{
    counter_state *st = c->state;
    float gy = ((const float *)c->gout[0].data)[0];
    st->gw += gy * sum_of(&c->in[0]);
    if (c->gin[0].data != NULL)
        for (int64_t i = 0; i < kt_tensor_numel(&c->gin[0]); i++)
            ((float *)c->gin[0].data)[i] = st->w * gy;
    return KT_OK;
}

/* ---- its hooks --------------------------------------------------------------------------- */

static kt_status bind_counter(const kt__op_bind *b, void **state_out)
{
    *state_out = NULL;
    if (b->n_nodes == 0)
        return KT_OK;
    if (b->n_nodes > 1)
        return kt__error(KT_EINVAL, "counter: one node per program ('%s' is the second)",
                         b->nodes[1].name);
    counter_state *st = calloc(1, sizeof *st);
    if (st == NULL)
        return kt__error(KT_ENOMEM, "counter: out of memory");
    st->w = 1.0f;
    bound++;
    *state_out = st;
    return KT_OK;
}

static void unbind_counter(void *state)
{
    unbound += state != NULL;
    free(state);
}

static int64_t span_floats_counter(const kt__op_bind *b) { return b->n_nodes > 0; }

static int spans_counter(void *state, kt__op_span *out, int cap)
{
    counter_state *st = state;
    if (out != NULL && cap >= 1)
        out[0] = (kt__op_span){.param = &st->w, .grad = &st->gw, .n = 1, .name = "counter.w"};
    return 1;
}

static kt_status forward_begin_counter(void *state, int report)
{
    counter_state *st = state;
    if (!st->poisoned)
        return KT_OK;
    st->poisoned = 0;
    return report ? kt__error(KT_ESTATE, "counter: refused once after a failed step") : KT_OK;
}

static void backward_begin_counter(void *state) { ((counter_state *)state)->gw = 0.0f; }
static void backward_end_counter(void *state) { ((counter_state *)state)->backwards++; }
static void poison_counter(void *state) { ((counter_state *)state)->poisoned = 1; }

static size_t save_count_counter(void *state, size_t *name_bytes)
{
    (void)state;
    *name_bytes = 0; /* its names are literals */
    return 2;
}

static kt_status save_items_counter(void *state, kt_st_item *items, char *names)
{
    counter_state *st = state;
    (void)names;
    kt_tensor_init(&items[0].tensor, &st->w, KT_F32, 1, (int64_t[]){1});
    kt_tensor_init(&items[1].tensor, st->stats, KT_F32, 1, (int64_t[]){2});
    items[0].name = "counter.w", items[1].name = "counter.stats";
    return KT_OK;
}

static kt_status save_meta_counter(void *state, char *value, size_t cap)
{
    (void)state;
    snprintf(value, cap, "1");
    return KT_OK;
}

static int file_holds_counter(void *state, const kt_st_file *f)
{
    (void)state;
    return kt_st_metadata(f, "kt.counter") != NULL;
}

static kt_status load_counter(void *state, const kt_st_file *f, int dry_run, const char *path)
{
    counter_state *st = state;
    kt_tensor dst[2], view;
    kt_tensor_init(&dst[0], &st->w, KT_F32, 1, (int64_t[]){1});
    kt_tensor_init(&dst[1], st->stats, KT_F32, 1, (int64_t[]){2});
    const char *names[2] = {"counter.w", "counter.stats"};
    for (int i = 0; i < 2; i++) {
        if (kt_st_find(f, names[i], &view) != KT_OK || view.dtype != KT_F32 ||
            !kt_tensor_same_shape(&view, &dst[i]))
            return kt__error(KT_EINVAL, "%s: no f32[%lld] '%s'", path,
                             (long long)dst[i].shape[0], names[i]);
        if (!dry_run)
            KT__TRY(kt_st_read(f, names[i], &dst[i]));
    }
    return KT_OK;
}

static int knows_counter(void *state, const char *name, int is_state)
{
    (void)state;
    return strcmp(name, "counter.w") == 0 || (!is_state && strcmp(name, "counter.stats") == 0);
}

static const kt__op_state counter_hooks = {
    .bind = bind_counter, .unbind = unbind_counter, .span_floats = span_floats_counter,
    .spans = spans_counter, .forward_begin = forward_begin_counter,
    .backward_begin = backward_begin_counter, .backward_end = backward_end_counter,
    .poison = poison_counter, .save_count = save_count_counter,
    .save_items = save_items_counter, .meta_key = "kt.counter", .save_meta = save_meta_counter,
    .file_holds = file_holds_counter, .load = load_counter, .knows = knows_counter};

static const kt__op_desc counter_row = {
    .name = "counter", .min_in = 1, .max_in = 1, .n_out = 1, .bwd_reads_in = 1u,
    .infer = infer_counter, .forward = fwd_counter, .backward = bwd_counter,
    .state = &counter_hooks};

/* ---- the session ------------------------------------------------------------------------- */

static int setup(void **ctx)
{
    (void)ctx;
    kt__op_override_for_test(HOST_OP, &counter_row);
    return 0;
}

static int teardown(void **ctx)
{
    (void)ctx;
    kt__op_override_for_test(HOST_OP, NULL);
    return 0;
}

/* loss = y + bias: the graph's own parameter next to the op's */
static void add_loss(kt_graph *g, kt_value y)
{
    kt_value bias, loss;
    OK(kt_graph_param(g, "bias", KT_F32, 1, (int64_t[]){1}, (kt_init){KT_INIT_ZEROS, 0, 0},
                      &bias));
    OK(kt_graph_op(g, "loss", KT_OP_ADD, &(kt_op_attrs){0}, (kt_value[]){y, bias}, 2, &loss));
    OK(kt_graph_set_loss(g, loss));
}

/* loss = counter(x) + bias over x [4] (both the graph's parameters). */
static kt_program *counter_program(void)
{
    kt_graph *g = NULL;
    kt_program *p = NULL;
    kt_value x, y;
    OK(kt_graph_create(&g));
    /* a parameter: autodiff runs an op's backward only when an input wants a gradient */
    OK(kt_graph_param(g, "x", KT_F32, 1, (int64_t[]){4}, (kt_init){KT_INIT_ZEROS, 0, 0}, &x));
    OK(kt_graph_op(g, "count", HOST_OP, &(kt_op_attrs){0}, &x, 1, &y));
    add_loss(g, y);
    OK(kt_compile(g, NULL, &p));
    kt_graph_destroy(g);
    return p;
}

static counter_state *state_of(kt_session *s)
{
    for (int i = 0; i < s->n_stateful; i++)
        if (s->stateful[i].op == HOST_OP)
            return s->stateful[i].state;
    return NULL;
}

static void set_x(kt_session *s, float v)
{
    kt_tensor t;
    OK(kt_session_tensor(s, KT_ROLE_PARAM, "x", &t));
    for (int i = 0; i < 4; i++)
        ((float *)t.data)[i] = v + (float)i;
}

static void train_poison_save_load(void **ctx)
{
    (void)ctx;
    bound = unbound = 0;
    kt_program *p = counter_program();
    kt_session_options o = {.threads = 1,
                            .optimizer = {.kind = KT_OPTIM_SGD, .lr = 0.125f, .momentum = 0.5f}};
    kt_session *s = NULL;
    OK(kt_session_create(p, &o, &s));
    assert_int_equal(bound, 1);
    counter_state *st = state_of(s);
    assert_non_null(st);
    uint64_t with = 0, without = 0; /* momentum: one state for the gradient region and one
                                     * for the op's span of one float */
    kt_program_stats ps;
    kt_program_get_stats(p, &ps);
    OK(kt_session_memory_bytes(p, &o, &with));
    o.optimizer.momentum = 0.0f;
    OK(kt_session_memory_bytes(p, &o, &without));
    assert_int_equal(with - without, ps.grad_bytes + sizeof(float));

    set_x(s, 1.0f); /* x = 1 2 3 4: sum 10 */
    OK(kt_session_forward(s));
    assert_true(kt_session_loss(s) == 10.0f);
    OK(kt_session_backward(s));
    assert_true(st->gw == 10.0f);
    assert_int_equal(st->backwards, 1);
    OK(kt_session_step(s));
    assert_true(st->w == 1.0f - 0.125f * 10.0f); /* -0.25 */
    /* the graph's gradients (bias 1, x 1 1 1 1), then the op's span (w 10) */
    assert_true(kt_session_grad_norm(s) == (float)sqrt(1.0 + 4.0 + 100.0));
    assert_true(st->stats[0] == 1.0f && st->stats[1] == 10.0f);

    /* a failed forward poisons the state; the next forward reports it once */
    OK(kt__session_inject_failure(s, 0));
    assert_int_equal(kt_session_forward(s), KT_EINTERNAL);
    assert_int_equal(st->poisoned, 1);
    assert_int_equal(kt_session_forward(s), KT_ESTATE);
    assert_non_null(strstr(kt_last_error(), "counter: refused once"));
    OK(kt_session_forward(s));
    assert_true(kt_session_loss(s) == -0.25f * 9.5f - 0.125f); /* x and bias moved by -0.125 */

    /* save, change everything, load back: the op's items, metadata and optimizer spans */
    char path[] = "/tmp/kt_state_op_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    OK(kt_session_save(s, path, 1));
    kt_st_file *f = NULL;
    OK(kt_st_open(path, &f));
    assert_string_equal(kt_st_metadata(f, "kt.counter"), "1");
    kt_tensor view;
    OK(kt_st_find(f, "counter.stats", &view));
    OK(kt_st_find(f, "optimizer.momentum.counter.w", &view));
    float m0;
    memcpy(&m0, view.data, sizeof m0); /* a file view may be unaligned */
    assert_true(m0 == 10.0f); /* the first step's momentum */
    kt_st_close(f);
    const float saved_w = st->w, saved_n = st->stats[0];
    OK(kt_session_backward(s));
    OK(kt_session_step(s));
    assert_true(st->w != saved_w);
    OK(kt_session_load(s, path, KT_LOAD_OPTIMIZER));
    assert_true(st->w == saved_w && st->stats[0] == saved_n);
    assert_true(s->stateful[0].spans[0].state[0][0] == 10.0f);

    /* a file whose op state has the wrong shape changes nothing (the dry run refuses it) */
    float big[3] = {7, 7, 7};
    kt_st_item items[2] = {{"counter.w", {0}}, {"counter.stats", {0}}};
    kt_tensor_init(&items[0].tensor, big, KT_F32, 1, (int64_t[]){1});
    kt_tensor_init(&items[1].tensor, big, KT_F32, 1, (int64_t[]){3});
    const char *meta[] = {"kt.counter", "1", NULL};
    OK(kt_st_save(path, items, 2, meta));
    assert_int_equal(kt_session_load(s, path, KT_LOAD_ALLOW_MISSING), KT_EINVAL);
    assert_non_null(strstr(kt_last_error(), "counter.stats"));
    assert_true(st->w == saved_w);
    /* a name no op knows is refused unless allowed */
    kt_st_item other = {"counter.other", {0}};
    kt_tensor_init(&other.tensor, big, KT_F32, 1, (int64_t[]){1});
    OK(kt_st_save(path, &other, 1, NULL));
    TU_EXPECT_ERROR(kt_session_load(s, path, KT_LOAD_ALLOW_MISSING), KT_EINVAL, "counter.other");
    unlink(path);

    kt_session_destroy(s);
    assert_int_equal(unbound, 1);
    kt_program_destroy(p);
}

/* The bind hook's refusal fails kt_session_create and leaves the handle NULL. */
static void bind_refusal(void **ctx)
{
    (void)ctx;
    kt_graph *g = NULL;
    kt_program *p = NULL;
    kt_value x, y[2], sum;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 1, (int64_t[]){4}, &x));
    OK(kt_graph_op(g, "a", HOST_OP, &(kt_op_attrs){0}, &x, 1, &y[0]));
    OK(kt_graph_op(g, "b", HOST_OP, &(kt_op_attrs){.alpha = 1}, &x, 1, &y[1]));
    OK(kt_graph_op(g, "sum", KT_OP_ADD, &(kt_op_attrs){0}, y, 2, &sum));
    add_loss(g, sum);
    OK(kt_compile(g, &(kt_compile_options){.training = 1, .no_cse = 1}, &p));
    kt_graph_destroy(g);
    kt_session *s = (kt_session *)(uintptr_t)0x5a5a; /* garbage: a failed create clears it */
    assert_int_equal(kt_session_create(p, NULL, &s), KT_EINVAL);
    assert_null(s);
    assert_non_null(strstr(kt_last_error(), "'b' is the second"));
    kt_program_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(train_poison_save_load),
        cmocka_unit_test(bind_refusal),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
