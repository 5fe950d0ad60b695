/* The human-readable plan (kt-graphc --print-plan). */
#include <stdarg.h>
#include <stdio.h>

#include "graph/program_internal.h"
#include "lib/core/text.h"

static void say_buf(kt__text *t, const kt_program *p, int32_t id)
{
    if (id < 0) {
        kt__say(t, " -");
        return;
    }
    char d[96];
    kt__say(t, " b%d:%s", id, kt_tensor_describe(&p->bufs[id].meta, d, sizeof d));
}

size_t kt_program_describe(const kt_program *p, char *buf, size_t size)
{
    kt__text t = {buf, size, 0};
    if (buf != NULL && size > 0)
        buf[0] = '\0';
    kt_program_stats st;
    kt_program_get_stats(p, &st);
    static const char *const kinds[KT__STEP_KIND_COUNT] = {"fwd", "bwd", "fill", "accum"};
    static const char *const regions[KT__REGION_COUNT] = {"act", "param", "grad"};

    kt__say(&t, "schedule: %d forward + %d backward steps\n", st.n_forward_steps,
        st.n_backward_steps);
    for (int32_t at = 0; at < p->n_steps; at++) {
        const kt__pstep *s = &p->steps[at];
        kt__say(&t, "  %4d %-5s %-14s %-24s", at,
            (s->flags & KT__STEP_RECOMPUTE) ? "recmp" : kinds[s->kind],
            s->kind <= KT__STEP_BACKWARD ? kt_op_name(s->op) : "",
            kt__strings_get(&p->strings, s->name));
        kt__say(&t, " in");
        for (int32_t i = 0; i < s->n_in; i++)
            say_buf(&t, p, s->in[i]);
        kt__say(&t, " | out");
        for (int32_t o = 0; o < s->n_out; o++)
            say_buf(&t, p, s->out[o]);
        if (s->kind == KT__STEP_BACKWARD) {
            kt__say(&t, " | grad out");
            for (int32_t o = 0; o < s->n_out; o++)
                say_buf(&t, p, s->gout[o]);
            kt__say(&t, " | grad in");
            for (int32_t i = 0; i < s->n_in; i++)
                say_buf(&t, p, s->gin[i]);
        }
        if (s->scratch >= 0)
            kt__say(&t, " | scratch b%d", s->scratch);
        if (s->flags & KT__STEP_STATE_RECOMPUTES)
            kt__say(&t, " | layer keeps no intermediates");
        kt__say(&t, "\n");
    }
    kt__say(&t, "buffers: %d\n", p->n_bufs);
    for (int32_t b = 0; b < p->n_bufs; b++) {
        const kt__pbuf *pb = &p->bufs[b];
        char d[96];
        kt__say(&t, "  b%-5d %-5s offset %10llu  bytes %10llu  %-20s", b, regions[pb->region],
            (unsigned long long)pb->offset, (unsigned long long)pb->bytes,
            kt_tensor_describe(&pb->meta, d, sizeof d));
        if (pb->region == KT__REGION_ACT)
            kt__say(&t, "  live [%d, %d]%s", pb->first, pb->last,
                pb->storage != b ? " (in place)" : "");
        kt__say(&t, "\n");
    }
    kt__say(&t, "activation arena: planned peak %llu bytes, lower bound %llu bytes (%.3fx)\n",
        (unsigned long long)st.arena_bytes, (unsigned long long)st.lower_bound_bytes,
        st.lower_bound_bytes ? (double)st.arena_bytes / (double)st.lower_bound_bytes : 1.0);
    kt__say(&t, "parameters: %llu bytes, gradients: %llu bytes\n",
        (unsigned long long)st.param_bytes, (unsigned long long)st.grad_bytes);
    kt__say(&t, "flops: forward %.4g, backward %.4g, recompute %.4g (%d steps)\n",
        st.forward_flops, st.backward_flops, st.recompute_flops, st.n_recompute_steps);
    return t.len;
}
