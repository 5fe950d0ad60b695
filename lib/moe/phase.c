/* Phase timing of the MoE layer (kt/moe.h: kt_moe_get_phase_times). */
#include <string.h>
#include <time.h>

#include "lib/moe/moe_internal.h"

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void kt__moe_phase_start(kt_moe *m) { m->timing.phase_mark = now_ns(); }

void kt__moe_phase_end(kt_moe *m, kt_moe_phase phase)
{
    const uint64_t t = now_ns();
    m->timing.phases.ns[phase] += t - m->timing.phase_mark;
    m->timing.phase_mark = t;
}

void kt_moe_get_phase_times(const kt_moe *moe, kt_moe_phase_times *times_out)
{
    if (times_out == NULL)
        return;
    if (moe == NULL) {
        memset(times_out, 0, sizeof *times_out);
        return;
    }
    *times_out = moe->timing.phases;
}

void kt_moe_reset_phase_times(kt_moe *moe)
{
    if (moe != NULL)
        memset(&moe->timing.phases, 0, sizeof moe->timing.phases);
}

const char *kt_moe_phase_name(int phase)
{
    static const char *const names[KT_MOE_PHASE_COUNT] = {
        "route",        "gather",    "gate_up",      "down",        "combine",      "recompute",
        "routing_grad", "down_grad", "gate_up_grad", "weight_grad", "input_combine"};
    return phase >= 0 && phase < KT_MOE_PHASE_COUNT ? names[phase] : NULL;
}
