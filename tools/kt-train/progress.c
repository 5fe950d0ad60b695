/* kt-train's progress: the live line or the plain lines, RUN_DIR/metrics.jsonl and the loss
 * chart (loss_plot.c). Only rank 0 makes one. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kt/io.h"
#include "tools/kt-train/loss_plot.h"
#include "tools/kt-train/progress.h"
#include "tools/kt-train/train.h"

/* the live line is redrawn at most this often (seconds) */
static const double REDRAW_S = 0.1;

typedef struct curve {
    int64_t *step;
    double *loss;
    size_t n, cap;
} curve;

struct progress {
    progress_options o;
    int live;          /* the live line (a terminal, not force_plain) */
    int line_shown;    /* the live line is on screen, without its newline */
    int text_width;    /* the longest live text so far: the bar keeps its width */
    int64_t drawn_step; /* the step the live line last showed */
    char *run_dir, *metrics_path, *plot_path;
    FILE *metrics;     /* appended and flushed per record */
    /* a record (METRICS, PLOT) that could not be written: its later writes stop, the other
     * goes on; what and where is said at close */
    int failed[2];
    char failure[2][1100];
    double t0;         /* when the run (this process) started */
    double elapsed0;   /* elapsed_s of the records kept from before a resume */
    double last_step_t, last_draw_t, log_since_t;
    int64_t step, log_since_step;
    double loss, lr, heldout;
    curve train, eval;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static char *join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *s = malloc(n);
    if (s != NULL)
        snprintf(s, n, "%s/%s", dir, name);
    return s;
}

static int curve_add(curve *c, int64_t step, double loss)
{
    if (c->n == c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 1024;
        int64_t *s = realloc(c->step, cap * sizeof *s);
        if (s == NULL)
            return 1;
        c->step = s;
        double *l = realloc(c->loss, cap * sizeof *l);
        if (l == NULL)
            return 1;
        c->loss = l;
        c->cap = cap;
    }
    c->step[c->n] = step;
    c->loss[c->n++] = loss;
    return 0;
}

enum { METRICS, PLOT };

/* The first failure to write a record, kept to be said once at close. */
static void record_failure(progress *p, int which, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void record_failure(progress *p, int which, const char *fmt, ...)
{
    if (p->failed[which])
        return;
    p->failed[which] = 1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->failure[which], sizeof p->failure[which], fmt, ap);
    va_end(ap);
}

/* ---- metrics.jsonl ----------------------------------------------------------------------- */

/* A number in JSON: null when it is not finite (JSON has no NaN or infinity) or unknown. */
static void json_number(char *buf, size_t size, double v)
{
    if (isfinite(v))
        snprintf(buf, size, "%.9g", v);
    else
        snprintf(buf, size, "null");
}

/* The value of "key": in one record line: 1 with *v (NaN for null), 0 when absent. Records
 * are flat objects of numbers written by append_record, so a key is found by its quoted name
 * (`"loss":` cannot match inside `"eval_loss":`). */
static int json_field(const char *line, const char *key, double *v)
{
    char pat[32];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *at = strstr(line, pat);
    if (at == NULL)
        return 0;
    at += strlen(pat);
    while (*at == ' ')
        at++;
    if (strncmp(at, "null", 4) == 0) {
        *v = NAN;
        return 1;
    }
    char *end;
    *v = strtod(at, &end);
    return end != at;
}

static void append_record(progress *p, const char *line)
{
    if (p->metrics == NULL || p->failed[METRICS])
        return;
    if (fputs(line, p->metrics) == EOF || fflush(p->metrics) != 0)
        record_failure(p, METRICS, "cannot write %s: %s", p->metrics_path, strerror(errno));
}

/* Keeps the records of steps <= first_step (rewriting the file whole when some go) and loads
 * them into the curves; a line cut short by a killed run is dropped with the later ones. */
static int resume_metrics(progress *p)
{
    FILE *f = fopen(p->metrics_path, "r");
    if (f == NULL)
        return errno == ENOENT ? 0 : train_error("cannot read %s: %s", p->metrics_path,
                                                 strerror(errno));
    kt_out_file *out = NULL;
    if (kt_out_open(p->metrics_path, &out) != KT_OK) {
        fclose(f);
        return train_error("%s", kt_last_error());
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int rc = 0;
    while ((len = getline(&line, &cap, f)) > 0) {
        double step, v;
        if (line[len - 1] != '\n' || !json_field(line, "step", &step) || !(step >= 1) ||
            step > (double)p->o.first_step)
            continue;
        if (json_field(line, "eval_loss", &v))
            rc |= curve_add(&p->eval, (int64_t)step, v);
        else if (json_field(line, "loss", &v))
            rc |= curve_add(&p->train, (int64_t)step, v);
        if (json_field(line, "elapsed_s", &v) && isfinite(v) && v > p->elapsed0)
            p->elapsed0 = v;
        kt_out_write(out, line, (size_t)len);
    }
    int read_error = ferror(f);
    free(line);
    fclose(f);
    if (rc != 0 || read_error) {
        kt_out_discard(out);
        return rc != 0 ? train_error("out of memory reading %s", p->metrics_path)
                       : train_error("cannot read %s", p->metrics_path);
    }
    if (kt_out_commit(out) != KT_OK)
        return train_error("%s", kt_last_error());
    if (p->train.n > 0)
        p->loss = p->train.loss[p->train.n - 1];
    if (p->eval.n > 0)
        p->heldout = p->eval.loss[p->eval.n - 1];
    return 0;
}

static int open_records(progress *p)
{
    if (mkdir(p->run_dir, 0777) != 0 && errno != EEXIST)
        return train_error("cannot create the run directory %s: %s", p->run_dir, strerror(errno));
    struct stat sb;
    if (stat(p->run_dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return train_error("the run directory %s is not a directory", p->run_dir);
    p->metrics_path = join(p->run_dir, "metrics.jsonl");
    p->plot_path = join(p->run_dir, "loss.svg");
    if (p->metrics_path == NULL || p->plot_path == NULL)
        return train_error("out of memory");
    if (p->o.first_step > 0) {
        if (resume_metrics(p) != 0)
            return 1;
    } else { /* a new run: the records of an earlier one in this directory would mix in */
        kt_out_file *out = NULL;
        if (kt_out_open(p->metrics_path, &out) != KT_OK || kt_out_commit(out) != KT_OK)
            return train_error("%s", kt_last_error());
    }
    p->metrics = fopen(p->metrics_path, "a");
    if (p->metrics == NULL)
        return train_error("cannot write %s: %s", p->metrics_path, strerror(errno));
    return 0;
}

static void write_plot(progress *p)
{
    if (p->plot_path == NULL || p->failed[PLOT])
        return;
    loss_series t = {p->train.step, p->train.loss, p->train.n};
    loss_series e = {p->eval.step, p->eval.loss, p->eval.n};
    char title[600];
    snprintf(title, sizeof title, "kt-train loss: %s", p->run_dir);
    if (loss_plot_write(p->plot_path, title, t, e, p->o.total_steps) != KT_OK)
        record_failure(p, PLOT, "%s", kt_last_error());
}

/* ---- the display ------------------------------------------------------------------------- */

/* 0:12, 1:03:07 */
static void clock_text(char *buf, size_t size, double s)
{
    if (!isfinite(s) || s < 0) {
        snprintf(buf, size, "?");
        return;
    }
    long t = (long)(s + 0.5);
    if (t >= 3600)
        snprintf(buf, size, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else
        snprintf(buf, size, "%ld:%02ld", t / 60, t % 60);
}

static int terminal_width(FILE *out)
{
    struct winsize ws;
    if (ioctl(fileno(out), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0)
        return ws.ws_col;
    return 80;
}

/* Erases the live line so that a message can take its place. */
static void clear_line(progress *p)
{
    if (p->line_shown) {
        fputs("\r\033[K", p->o.out);
        p->line_shown = 0;
    }
}

static void draw_line(progress *p, double now)
{
    double elapsed = now - p->t0;
    int64_t done = p->step - p->o.first_step;
    double per_step = done > 0 ? elapsed / (double)done : NAN;
    char el[32], eta[32], text[256], held[48] = "", rate[32] = "?";
    clock_text(el, sizeof el, elapsed);
    clock_text(eta, sizeof eta, per_step * (double)(p->o.total_steps - p->step));
    if (!isnan(p->heldout))
        snprintf(held, sizeof held, " held-out %.4f", p->heldout);
    if (per_step > 0)
        snprintf(rate, sizeof rate, "%.0f", (double)p->o.tokens_per_step / per_step);
    int len = snprintf(text, sizeof text, "step %lld/%lld loss %.4f%s %s tok/s %s eta %s",
                       (long long)p->step, (long long)p->o.total_steps, p->loss, held, rate,
                       el, eta);
    if (len < 0)
        return;
    if (len >= (int)sizeof text)
        len = (int)sizeof text - 1;
    if (len > p->text_width)
        p->text_width = len;
    while (len < p->text_width && len < (int)sizeof text - 1) /* padded: a steady bar */
        text[len++] = ' ';
    /* one column short of the width: a line that fills it would wrap on some terminals and
     * \r would then redraw only its last row */
    int width = terminal_width(p->o.out) - 1, bar = width - len - 3;
    fputs("\r", p->o.out);
    if (bar >= 10) {
        int64_t span = p->o.total_steps > 0 ? p->o.total_steps : 1;
        int filled = (int)((double)bar * (double)p->step / (double)span);
        if (filled > bar)
            filled = bar;
        fputc('[', p->o.out);
        for (int k = 0; k < bar; k++)
            fputc(k < filled ? '#' : '.', p->o.out);
        fputs("] ", p->o.out);
    }
    fwrite(text, 1, (size_t)(len < width ? len : width > 0 ? width : 0), p->o.out);
    fputs("\033[K", p->o.out);
    fflush(p->o.out);
    p->line_shown = 1;
    p->last_draw_t = now;
    p->drawn_step = p->step;
}

static void plain_line(progress *p, double now)
{
    int64_t steps = p->step - p->log_since_step;
    double dt = steps > 0 ? (now - p->log_since_t) / (double)steps : 0; /* per step */
    double elapsed = now - p->t0;
    int64_t done = p->step - p->o.first_step;
    char el[32], eta[32];
    clock_text(el, sizeof el, elapsed);
    clock_text(eta, sizeof eta, done > 0 ? elapsed / (double)done *
                                               (double)(p->o.total_steps - p->step) : NAN);
    fprintf(p->o.out, "step %lld/%lld loss %.4f lr %.1e (%.*f ms, %.0f tokens/s, elapsed %s, "
                      "eta %s)\n",
            (long long)p->step, (long long)p->o.total_steps, p->loss, p->lr, dt < 0.01 ? 2 : 0,
            dt * 1e3, dt > 0 ? (double)p->o.tokens_per_step / dt : 0.0, el, eta);
    fflush(p->o.out);
    p->log_since_t = now;
    p->log_since_step = p->step;
}

/* ---- the interface ----------------------------------------------------------------------- */

int progress_open(progress **out, const progress_options *o)
{
    *out = NULL;
    progress *p = calloc(1, sizeof *p);
    if (p == NULL)
        return train_error("out of memory");
    p->o = *o;
    if (p->o.out == NULL)
        p->o.out = stdout;
    if (p->o.log_every < 1)
        p->o.log_every = 1;
    p->live = !o->force_plain && isatty(fileno(p->o.out));
    p->t0 = p->last_step_t = p->log_since_t = now_s();
    p->last_draw_t = -INFINITY;
    p->step = p->log_since_step = o->first_step;
    p->loss = p->lr = p->heldout = NAN;
    if (o->run_dir != NULL) {
        p->run_dir = malloc(strlen(o->run_dir) + 1);
        if (p->run_dir == NULL) {
            progress_close(p);
            return train_error("out of memory");
        }
        strcpy(p->run_dir, o->run_dir);
        if (open_records(p) != 0) {
            progress_close(p);
            return 1;
        }
    }
    *out = p;
    return 0;
}

void progress_step(progress *p, int64_t step, double loss, double lr, double grad_norm)
{
    double now = now_s(), dt = now - p->last_step_t;
    int64_t steps = step - p->step;
    p->last_step_t = now;
    p->step = step;
    p->loss = loss;
    p->lr = lr;
    if (p->metrics != NULL) {
        char l[40], r[40], g[40], tps[40], el[40], rec[300];
        json_number(l, sizeof l, loss);
        json_number(r, sizeof r, lr);
        json_number(g, sizeof g, grad_norm >= 0 ? grad_norm : NAN);
        json_number(tps, sizeof tps,
                    dt > 0 && steps > 0 ? (double)(steps * p->o.tokens_per_step) / dt : NAN);
        json_number(el, sizeof el, p->elapsed0 + (now - p->t0));
        snprintf(rec, sizeof rec,
                 "{\"step\":%lld,\"loss\":%s,\"lr\":%s,\"grad_norm\":%s,\"tokens_per_s\":%s,"
                 "\"elapsed_s\":%s}\n",
                 (long long)step, l, r, g, tps, el);
        append_record(p, rec);
        if (curve_add(&p->train, step, loss) != 0)
            record_failure(p, PLOT, "out of memory keeping the loss curve for %s", p->plot_path);
    }
    if (p->live) {
        if (now - p->last_draw_t >= REDRAW_S || step >= p->o.total_steps)
            draw_line(p, now);
    } else if (step % p->o.log_every == 0 || step >= p->o.total_steps) {
        plain_line(p, now);
    }
}

void progress_eval(progress *p, int64_t step, double loss, double bits_per_byte)
{
    double ppl = exp(loss);
    p->heldout = loss;
    char line[160], bpb[48] = "";
    if (bits_per_byte >= 0)
        snprintf(bpb, sizeof bpb, ", %.3f bits/byte", bits_per_byte);
    snprintf(line, sizeof line, "eval step %lld: held-out loss %.4f (ppl %.2f%s)",
             (long long)step, loss, ppl, bpb);
    progress_note(p, "%s", line);
    if (p->metrics != NULL) {
        char l[40], pp[40], b[40], rec[200];
        json_number(l, sizeof l, loss);
        json_number(pp, sizeof pp, ppl);
        json_number(b, sizeof b, bits_per_byte >= 0 ? bits_per_byte : NAN);
        snprintf(rec, sizeof rec, "{\"step\":%lld,\"eval_loss\":%s,\"eval_ppl\":%s,"
                                  "\"bits_per_byte\":%s}\n",
                 (long long)step, l, pp, b);
        append_record(p, rec);
        if (curve_add(&p->eval, step, loss) != 0)
            record_failure(p, PLOT, "out of memory keeping the held-out curve for %s",
                           p->plot_path);
        write_plot(p);
    }
}

void progress_note(progress *p, const char *fmt, ...)
{
    int redraw = p->line_shown;
    clear_line(p);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(p->o.out, fmt, ap);
    va_end(ap);
    fputc('\n', p->o.out);
    fflush(p->o.out);
    if (redraw)
        draw_line(p, now_s());
}

int progress_close(progress *p)
{
    if (p == NULL)
        return 0;
    if (p->live && p->step > p->o.first_step) {
        if (!p->line_shown || p->drawn_step != p->step)
            draw_line(p, now_s()); /* the last step, also when its redraw was skipped */
        fputc('\n', p->o.out);
        fflush(p->o.out);
    }
    if (p->metrics != NULL) {
        write_plot(p);
        if (fclose(p->metrics) != 0)
            record_failure(p, METRICS, "cannot write %s: %s", p->metrics_path, strerror(errno));
    }
    int rc = 0;
    for (int k = METRICS; k <= PLOT; k++)
        if (p->failed[k])
            rc = train_error("%s", p->failure[k]);
    free(p->run_dir);
    free(p->metrics_path);
    free(p->plot_path);
    free(p->train.step);
    free(p->train.loss);
    free(p->eval.step);
    free(p->eval.loss);
    free(p);
    return rc;
}
