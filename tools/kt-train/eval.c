/* The held-out evaluation: the mean loss of the program's forward over windows 0 .. M-1 of
 * --eval-data (the same window size and feeds as training), in nats per counted target, and in
 * bits per byte when the file says how many source bytes a token stands for. The unigram
 * baseline (the training file's token frequencies scored on the same windows) is the bar a
 * model must pass to have learnt anything beyond which tokens are common.
 *
 * An evaluation runs between optimizer steps, where no gradient is accumulated, and runs only
 * forwards: the parameters, the optimizer state and the accumulation are not touched. What a
 * forward leaves behind is either overwritten by the next training forward (the inputs, the
 * activations, the MoE layers' kept activations) or cleared here (a MoE layer's forward cache,
 * which would otherwise offer the held-out routing to the next step's recompute). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tools/kt-train/trainer.h"

int eval_open(trainer *t, const train_args *a)
{
    if (data_open(&t->eval, a->eval_data, a, t->p, &t->r) != 0)
        return 1;
    int64_t whole = data_windows(&t->eval);
    if (whole < 1)
        return train_error("--eval-data %s holds no whole window of %lld tokens (and the one "
                           "after): too short to evaluate on", a->eval_data,
                           (long long)t->eval.window);
    t->eval_windows = a->eval_windows > 0 && a->eval_windows < whole ? a->eval_windows : whole;
    t->baseline_nats = -1.0;
    double nats;
    if (data_unigram_loss(&t->data, &t->eval, &nats) != 0)
        return 1;
    t->baseline_nats = nats;
    return 0;
}

int eval_run(trainer *t, double *loss_out)
{
    double sum = 0.0;
    for (int64_t w = 0; w < t->eval_windows; w++) {
        if (data_load_step(&t->eval, w, &t->r) != 0)
            return 1;
        if (kt_session_forward(t->s) != KT_OK)
            return train_error("held-out window %lld: forward failed on rank %d: %s",
                               (long long)w, t->r.rank, kt_last_error());
        sum += (double)kt_session_loss(t->s);
    }
    for (int i = 0; i < t->moe.n; i++)
        if (t->moe.layers[i] != NULL)
            kt_moe_cache_clear(t->moe.layers[i]);
    if (t->r.comm != NULL) { /* each rank's loss is of its slice: the mean over the ranks */
        float part = (float)sum;
        if (kt_comm_all_reduce(t->r.comm, &part, 1, KT_F32, KT_REDUCE_MEAN) != KT_OK)
            return train_error("rank %d: cannot average the held-out loss: %s", t->r.rank,
                               kt_last_error());
        sum = (double)part;
    }
    *loss_out = sum / (double)t->eval_windows;
    return 0;
}

void eval_describe(const trainer *t, double nats, char *buf, size_t size)
{
    double bytes = data_bytes_per_token(&t->eval);
    int n = snprintf(buf, size, "%.4f (perplexity %.4g", nats, exp(nats));
    if (n >= 0 && (size_t)n < size && bytes > 0)
        n += snprintf(buf + n, size - (size_t)n, ", %.4f bits/byte", nats / log(2.0) / bytes);
    if (n >= 0 && (size_t)n < size)
        snprintf(buf + n, size - (size_t)n, ")");
}
