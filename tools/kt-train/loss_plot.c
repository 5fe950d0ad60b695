/* RUN_DIR/loss.svg: a line chart of the run's losses, written as plain SVG text (any browser
 * shows it; no plotting library). Rewritten whole at each evaluation, so a reader never sees
 * half a chart. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kt/io.h"
#include "tools/kt-train/loss_plot.h"

enum { MAX_POINTS = 1000 };

/* the page and the plot area inside it, in SVG units */
static const double W = 800, H = 480, LEFT = 72, RIGHT = 24, TOP = 44, BOTTOM = 56;

typedef struct frame {
    double x_max, y_min, y_max;
} frame;

static double px(const frame *f, double step)
{
    return LEFT + step / f->x_max * (W - LEFT - RIGHT);
}

static double py(const frame *f, double loss)
{
    return TOP + (f->y_max - loss) / (f->y_max - f->y_min) * (H - TOP - BOTTOM);
}

/* 1, 2 or 5 times a power of ten, near x: tick spacing that reads well */
static double nice_step(double x)
{
    double e = pow(10.0, floor(log10(x)));
    double f = x / e;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * e;
}

/* Length of the UTF-8 sequence starting at s (at most n bytes), or 0 when it is not one. */
static size_t utf8_length(const unsigned char *s, size_t n)
{
    size_t len = s[0] < 0x80 ? 1 : (s[0] & 0xE0) == 0xC0 ? 2 : (s[0] & 0xF0) == 0xE0 ? 3
               : (s[0] & 0xF8) == 0xF0 ? 4 : 0;
    if (len == 0 || len > n || (len == 2 && s[0] < 0xC2))
        return 0;
    for (size_t k = 1; k < len; k++)
        if ((s[k] & 0xC0) != 0x80)
            return 0;
    return len;
}

/* Text as XML character data: markup escaped, control bytes and broken UTF-8 become '?'. */
static void put_text(kt_out_file *o, const char *text)
{
    const unsigned char *s = (const unsigned char *)text;
    size_t n = strlen(text);
    for (size_t i = 0; i < n;) {
        size_t len = utf8_length(s + i, n - i);
        if (len == 0 || (len == 1 && s[i] < 0x20)) {
            kt_out_write(o, "?", 1);
            i++;
            continue;
        }
        const char *esc = s[i] == '&' ? "&amp;" : s[i] == '<' ? "&lt;" : s[i] == '>' ? "&gt;"
                        : s[i] == '"' ? "&quot;" : NULL;
        if (esc != NULL)
            kt_out_write(o, esc, strlen(esc));
        else
            kt_out_write(o, s + i, len);
        i += len;
    }
}

/* The training loss in at most MAX_POINTS buckets of consecutive steps, each the mean of
 * its finite points. Returns the number of points. */
static size_t downsample(loss_series t, double *xs, double *ys)
{
    size_t buckets = t.n < MAX_POINTS ? t.n : MAX_POINTS, m = 0;
    for (size_t b = 0; b < buckets; b++) {
        size_t lo = b * t.n / buckets, hi = (b + 1) * t.n / buckets;
        double sx = 0, sy = 0;
        size_t k = 0;
        for (size_t i = lo; i < hi; i++)
            if (isfinite(t.loss[i])) {
                sx += (double)t.step[i];
                sy += t.loss[i];
                k++;
            }
        if (k > 0) {
            xs[m] = sx / (double)k;
            ys[m] = sy / (double)k;
            m++;
        }
    }
    return m;
}

/* A centred moving average over about 1/25 of the points, light enough to keep the curve's
 * shape; nothing for short curves. The window narrows towards the ends so that it stays
 * centred: a one-sided one would lag behind the steep start of a run. */
static size_t smooth(const double *ys, size_t m, double *out)
{
    if (m < 25)
        return 0;
    size_t half = m / 50 > 0 ? m / 50 : 1;
    for (size_t i = 0; i < m; i++) {
        size_t h = half < i ? half : i;
        h = h < m - 1 - i ? h : m - 1 - i;
        size_t lo = i - h, hi = i + h;
        double s = 0;
        for (size_t k = lo; k <= hi; k++)
            s += ys[k];
        out[i] = s / (double)(hi - lo + 1);
    }
    return m;
}

static void polyline(kt_out_file *o, const frame *f, const char *cls, const char *style,
                     const double *xs, const double *ys, size_t m)
{
    kt_out_printf(o, "<polyline class=\"%s\" fill=\"none\" %s points=\"", cls, style);
    for (size_t i = 0; i < m; i++)
        kt_out_printf(o, "%s%.1f,%.1f", i ? " " : "", px(f, xs[i]), py(f, ys[i]));
    kt_out_printf(o, "\"/>\n");
}

static void axes(kt_out_file *o, const frame *f)
{
    double x0 = LEFT, x1 = W - RIGHT, y0 = TOP, y1 = H - BOTTOM;
    double xs = nice_step(f->x_max / 6.0);
    if (xs < 1)
        xs = 1;
    double ys = nice_step((f->y_max - f->y_min) / 5.0);
    int ydec = ys >= 1 ? 0 : (int)ceil(-log10(ys) - 1e-9);
    kt_out_printf(o, "<g class=\"grid\" stroke=\"#e4e4e4\" stroke-width=\"1\">\n");
    for (double v = xs; v <= f->x_max + 1e-9; v += xs)
        kt_out_printf(o, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n", px(f, v), y0,
                      px(f, v), y1);
    for (double v = ceil(f->y_min / ys - 1e-9) * ys; v <= f->y_max + 1e-9 * ys; v += ys)
        kt_out_printf(o, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n", x0, py(f, v),
                      x1, py(f, v));
    kt_out_printf(o, "</g>\n<g class=\"axes\" stroke=\"black\" stroke-width=\"1\">\n"
                     "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n"
                     "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n",
                  x0, y1, x1, y1, x0, y0, x0, y1);
    for (double v = 0; v <= f->x_max + 1e-9; v += xs)
        kt_out_printf(o, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n", px(f, v), y1,
                      px(f, v), y1 + 5);
    for (double v = ceil(f->y_min / ys - 1e-9) * ys; v <= f->y_max + 1e-9 * ys; v += ys)
        kt_out_printf(o, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n", x0 - 5,
                      py(f, v), x0, py(f, v));
    kt_out_printf(o, "</g>\n<g class=\"tick-labels\" fill=\"#333\">\n");
    for (double v = 0; v <= f->x_max + 1e-9; v += xs)
        kt_out_printf(o, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.0f</text>\n",
                      px(f, v), y1 + 19, v);
    for (double v = ceil(f->y_min / ys - 1e-9) * ys; v <= f->y_max + 1e-9 * ys; v += ys)
        kt_out_printf(o, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%.*f</text>\n", x0 - 8,
                      py(f, v) + 4, ydec, fabs(v) < ys * 1e-9 ? 0.0 : v);
    kt_out_printf(o, "</g>\n"
                     "<text class=\"x-label\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">step</text>\n"
                     "<text class=\"y-label\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" "
                     "transform=\"rotate(-90 %.1f %.1f)\">loss (nats/token)</text>\n",
                  (x0 + x1) / 2, H - 14, 18.0, (y0 + y1) / 2, 18.0, (y0 + y1) / 2);
}

static void legend(kt_out_file *o, int has_train, int has_average, int has_heldout)
{
    const char *names[3] = {"train loss", "train, moving average", "held-out loss"};
    const char *styles[3] = {"stroke=\"#1f77b4\" stroke-opacity=\"0.35\"", "stroke=\"#1f77b4\"",
                             "stroke=\"#d62728\""};
    int shown[3] = {has_train, has_average, has_heldout}, rows = 0;
    for (int k = 0; k < 3; k++)
        rows += shown[k];
    if (rows == 0)
        return;
    double x = W - RIGHT - 190, y = TOP + 10;
    kt_out_printf(o, "<g class=\"legend\">\n<rect x=\"%.1f\" y=\"%.1f\" width=\"180\" "
                     "height=\"%.1f\" fill=\"white\" fill-opacity=\"0.85\" stroke=\"#999\"/>\n",
                  x, y, 8.0 + 18.0 * rows);
    for (int k = 0, r = 0; k < 3; k++) {
        if (!shown[k])
            continue;
        double ly = y + 16 + 18.0 * r++;
        kt_out_printf(o, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke-width=\"2\" %s/>\n",
                      x + 8, ly - 4, x + 36, ly - 4, styles[k]);
        if (k == 2)
            kt_out_printf(o, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"#d62728\"/>\n", x + 22,
                          ly - 4);
        kt_out_printf(o, "<text x=\"%.1f\" y=\"%.1f\">%s</text>\n", x + 44, ly, names[k]);
    }
    kt_out_printf(o, "</g>\n");
}

kt_status loss_plot_write(const char *path, const char *title, loss_series train,
                          loss_series heldout, int64_t x_max)
{
    double xs[MAX_POINTS], ys[MAX_POINTS], avg[MAX_POINTS];
    size_t m = downsample(train, xs, ys), n_avg = smooth(ys, m, avg);

    frame f = {(double)x_max, INFINITY, -INFINITY};
    for (size_t i = 0; i < m; i++) {
        f.y_min = fmin(f.y_min, ys[i]);
        f.y_max = fmax(f.y_max, ys[i]);
    }
    size_t n_held = 0;
    for (size_t i = 0; i < heldout.n; i++)
        if (isfinite(heldout.loss[i])) {
            f.y_min = fmin(f.y_min, heldout.loss[i]);
            f.y_max = fmax(f.y_max, heldout.loss[i]);
            n_held++;
        }
    if (train.n > 0 && (double)train.step[train.n - 1] > f.x_max)
        f.x_max = (double)train.step[train.n - 1];
    if (heldout.n > 0 && (double)heldout.step[heldout.n - 1] > f.x_max)
        f.x_max = (double)heldout.step[heldout.n - 1];
    if (f.x_max < 1)
        f.x_max = 1;
    if (f.y_min > f.y_max) { /* nothing to draw yet */
        f.y_min = 0;
        f.y_max = 1;
    }
    double pad = (f.y_max - f.y_min) * 0.05;
    if (pad < 1e-6)
        pad = fmax(0.05 * fabs(f.y_max), 0.05);
    f.y_min -= pad;
    f.y_max += pad;

    kt_out_file *o = NULL;
    kt_status st = kt_out_open(path, &o);
    if (st != KT_OK)
        return st;
    kt_out_printf(o, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
                     "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
                     "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"12\">\n"
                     "<title>",
                  W, H, W, H);
    put_text(o, title);
    kt_out_printf(o, "</title>\n<rect width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n"
                     "<text class=\"title\" x=\"%.1f\" y=\"26\" text-anchor=\"middle\" "
                     "font-size=\"15\">",
                  W, H, W / 2);
    put_text(o, title);
    kt_out_printf(o, "</text>\n");
    axes(o, &f);
    if (m == 0 && n_held == 0)
        kt_out_printf(o, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" fill=\"#999\">"
                         "no finite loss yet</text>\n",
                      (LEFT + W - RIGHT) / 2, (TOP + H - BOTTOM) / 2);
    if (m > 0)
        polyline(o, &f, "train", "stroke=\"#1f77b4\" stroke-opacity=\"0.35\" stroke-width=\"1\"",
                 xs, ys, m);
    if (n_avg > 0)
        polyline(o, &f, "train-average", "stroke=\"#1f77b4\" stroke-width=\"2\"", xs, avg, n_avg);
    if (n_held > 0) {
        double hx[MAX_POINTS], hy[MAX_POINTS];
        size_t k = 0;
        /* one marker per evaluation; a run with more than MAX_POINTS keeps the latest */
        for (size_t i = heldout.n > MAX_POINTS ? heldout.n - MAX_POINTS : 0; i < heldout.n; i++)
            if (isfinite(heldout.loss[i])) {
                hx[k] = (double)heldout.step[i];
                hy[k++] = heldout.loss[i];
            }
        kt_out_printf(o, "<g class=\"heldout\">\n");
        polyline(o, &f, "heldout-line", "stroke=\"#d62728\" stroke-width=\"2\"", hx, hy, k);
        for (size_t i = 0; i < k; i++)
            kt_out_printf(o, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"#d62728\"/>\n",
                          px(&f, hx[i]), py(&f, hy[i]));
        kt_out_printf(o, "</g>\n");
    }
    legend(o, m > 0, n_avg > 0, n_held > 0);
    kt_out_printf(o, "</svg>\n");
    return kt_out_commit(o);
}
