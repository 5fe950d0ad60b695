/* kt-train's loss chart (loss_plot.c): RUN_DIR/loss.svg, drawn by hand. Private to
 * progress.c, which keeps the series. */
#ifndef KT_TRAIN_LOSS_PLOT_H
#define KT_TRAIN_LOSS_PLOT_H

#include <stddef.h>
#include <stdint.h>

#include "kt/status.h"

typedef struct loss_series {
    const int64_t *step; /* increasing */
    const double *loss;  /* nats per token; points that are not finite are left out */
    size_t n;
} loss_series;

/* Writes the chart to `path` whole (kt_out_open/kt_out_commit): the training loss per step
 * (at most ~1000 points, with a moving average over it), the held-out loss (markers and a
 * line), axes with ticks and labels, a legend and `title` (any bytes: escaped, and what is
 * not UTF-8 replaced). The x axis runs from 0 to max(x_max, the last step). On failure,
 * kt_last_error() names the path. */
kt_status loss_plot_write(const char *path, const char *title, loss_series train,
                          loss_series heldout, int64_t x_max);

#endif
