/* Compares what libkt computed (kt-run's output file) with what transformers computed
 * (a fixture's reference.safetensors), tensor by tensor under the same names.
 *
 * usage: st_compare REF OUT [--logits TOL] [--loss TOL] [--grad TOL] [--select PREFIX]...
 *        st_compare --dims FILE NAME     prints the tensor's dimensions ("2 8")
 *
 * Every tensor of REF named "logits", "loss" or "grad.<name>" (or, with --select, those whose
 * name starts with one of the prefixes) must be in OUT with the same number of elements.
 * The error of a tensor is max |out - ref| over max |ref| (relative to the tensor's largest
 * magnitude, so that near-zero entries do not dominate); the loss's is |out - ref| / |ref|.
 * Every gradient OUT holds must be one REF holds too: libkt training a tensor transformers
 * does not (or under another name) is a failure as well. Prints one line per kind with the
 * worst tensor, and every tensor over its tolerance; exit 0 when all are within. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt/kt.h"

typedef struct kind_stats {
    const char *kind;
    double tol, worst;
    const char *worst_name;
    int compared, failed;
} kind_stats;

/* The tensor as doubles (f32, bf16, f16); NULL for another dtype. */
static double *to_f64(const kt_tensor *t, int64_t *n_out)
{
    const int64_t n = kt_tensor_numel(t);
    double *v = malloc((size_t)(n > 0 ? n : 1) * sizeof *v);
    if (v == NULL)
        return NULL;
    const unsigned char *p = t->data; /* file views may be unaligned: copy each element */
    for (int64_t i = 0; i < n; i++) {
        if (t->dtype == KT_F32) {
            float x;
            memcpy(&x, p + 4 * i, 4);
            v[i] = x;
        } else if (t->dtype == KT_BF16 || t->dtype == KT_F16) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            v[i] = t->dtype == KT_BF16 ? kt_bf16_to_f32_1(h) : kt_f16_to_f32_1(h);
        } else {
            free(v);
            return NULL;
        }
    }
    *n_out = n;
    return v;
}

static int all_zero(const kt_tensor *t)
{
    int64_t n = 0;
    double *v = to_f64(t, &n);
    int zero = v != NULL;
    for (int64_t i = 0; zero && i < n; i++)
        zero = v[i] == 0.0;
    free(v);
    return zero;
}

static int selected(const char *name, char **prefixes, int n_prefixes)
{
    if (n_prefixes == 0)
        return strcmp(name, "logits") == 0 || strcmp(name, "loss") == 0 ||
               strncmp(name, "grad.", 5) == 0;
    for (int i = 0; i < n_prefixes; i++)
        if (strncmp(name, prefixes[i], strlen(prefixes[i])) == 0)
            return 1;
    return 0;
}

/* Compares one tensor; 0 when it could be compared (within tolerance or not). */
static int compare(const char *name, const kt_tensor *ref, const kt_tensor *out, kind_stats *k)
{
    int64_t nr = 0, no = 0;
    double *r = to_f64(ref, &nr), *o = to_f64(out, &no);
    int rc = 0;
    if (r == NULL || o == NULL) {
        fprintf(stderr, "FAIL %s: dtype %s / %s cannot be compared\n", name,
                kt_dtype_name(ref->dtype), kt_dtype_name(out->dtype));
        rc = 1;
    } else if (nr != no) {
        fprintf(stderr, "FAIL %s: %lld elements in the reference, %lld in libkt's\n", name,
                (long long)nr, (long long)no);
        rc = 1;
    } else {
        double scale = 0.0, diff = 0.0;
        int64_t at = 0;
        for (int64_t i = 0; i < nr; i++) {
            scale = fmax(scale, fabs(r[i]));
            const double d = fabs(o[i] - r[i]);
            if (!(d <= diff)) { /* NaN counts as the worst */
                diff = isnan(d) ? INFINITY : d;
                at = i;
            }
        }
        const double err = scale > 0.0 ? diff / scale : diff;
        k->compared++;
        if (err > k->worst || k->worst_name == NULL) {
            k->worst = err;
            k->worst_name = name;
        }
        if (!(err <= k->tol)) {
            k->failed++;
            fprintf(stderr,
                    "FAIL %s: relative error %.3g > %.3g (element %lld: libkt %.9g, "
                    "transformers %.9g; largest |ref| %.4g)\n",
                    name, err, k->tol, (long long)at, o[at], r[at], scale);
        }
    }
    free(r);
    free(o);
    return rc;
}

static int print_dims(const char *path, const char *name)
{
    kt_st_file *f = NULL;
    kt_tensor t;
    if (kt_st_open(path, &f) != KT_OK || kt_st_find(f, name, &t) != KT_OK) {
        fprintf(stderr, "st_compare: %s\n", kt_last_error());
        kt_st_close(f);
        return 1;
    }
    for (int d = 0; d < t.ndim; d++)
        printf("%s%lld", d ? " " : "", (long long)t.shape[d]);
    printf("\n");
    kt_st_close(f);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        fprintf(argc < 3 ? stderr : stdout,
                "usage: st_compare REF OUT [--logits TOL] [--loss TOL] [--grad TOL] "
                "[--select PREFIX]...\n");
        return argc < 3 ? 2 : 0;
    }
    if (strcmp(argv[1], "--dims") == 0)
        return print_dims(argv[2], argc > 3 ? argv[3] : "");
    kind_stats kinds[3] = {{"logits", 1e-5, 0, NULL, 0, 0},
                           {"loss", 1e-6, 0, NULL, 0, 0},
                           {"grad", 1e-4, 0, NULL, 0, 0}};
    char *prefixes[16];
    int n_prefixes = 0;
    for (int i = 3; i < argc; i++) {
        if (i + 1 >= argc) {
            fprintf(stderr, "st_compare: %s needs a value\n", argv[i]);
            return 2;
        }
        if (strcmp(argv[i], "--select") == 0 && n_prefixes < 16) {
            prefixes[n_prefixes++] = argv[++i];
            continue;
        }
        int k = strcmp(argv[i], "--logits") == 0 ? 0
                : strcmp(argv[i], "--loss") == 0 ? 1
                : strcmp(argv[i], "--grad") == 0 ? 2
                                                  : -1;
        if (k < 0) {
            fprintf(stderr, "st_compare: unknown option %s\n", argv[i]);
            return 2;
        }
        char *end = NULL;
        kinds[k].tol = strtod(argv[++i], &end);
        if (end == argv[i] || *end != '\0' || !(kinds[k].tol >= 0.0)) {
            fprintf(stderr, "st_compare: %s %s: not a tolerance\n", argv[i - 1], argv[i]);
            return 2;
        }
    }

    kt_st_file *ref = NULL, *out = NULL;
    if (kt_st_open(argv[1], &ref) != KT_OK || kt_st_open(argv[2], &out) != KT_OK) {
        fprintf(stderr, "st_compare: %s\n", kt_last_error());
        kt_st_close(ref);
        return 1;
    }
    int problems = 0;
    for (size_t i = 0; i < kt_st_count(ref); i++) {
        const char *name;
        kt_tensor rt, ot;
        kt_st_entry(ref, i, &name, &rt);
        if (!selected(name, prefixes, n_prefixes))
            continue;
        if (kt_st_find(out, name, &ot) != KT_OK) {
            if (strncmp(name, "grad.", 5) == 0 && all_zero(&rt)) {
                /* a buffer transformers saves (DeepSeek-V3's e_score_correction_bias):
                 * libkt keeps it frozen, and its reference gradient is zero */
                printf("note   %s: frozen in libkt, zero in the reference\n", name);
                continue;
            }
            fprintf(stderr, "FAIL %s: not in libkt's output %s\n", name, argv[2]);
            problems++;
            continue;
        }
        kind_stats *k = strcmp(name, "logits") == 0 ? &kinds[0]
                        : strcmp(name, "loss") == 0  ? &kinds[1]
                                                     : &kinds[2];
        problems += compare(name, &rt, &ot, k);
    }
    for (size_t i = 0; i < kt_st_count(out); i++) {
        const char *name;
        kt_tensor t;
        kt_st_entry(out, i, &name, NULL);
        if (strncmp(name, "grad.", 5) == 0 && selected(name, prefixes, n_prefixes) &&
            kt_st_find(ref, name, &t) != KT_OK) {
            fprintf(stderr, "FAIL %s: libkt has this gradient, the reference does not\n", name);
            problems++;
        }
    }
    for (int k = 0; k < 3; k++) {
        problems += kinds[k].failed;
        if (kinds[k].compared > 0)
            printf("%-6s %3d tensor%s, worst relative error %.3g (%s), tolerance %.3g%s\n",
                   kinds[k].kind, kinds[k].compared, kinds[k].compared == 1 ? " " : "s",
                   kinds[k].worst, kinds[k].worst_name, kinds[k].tol,
                   kinds[k].failed ? "  FAILED" : "");
    }
    if (kinds[0].compared + kinds[1].compared + kinds[2].compared == 0) {
        fprintf(stderr, "FAIL: nothing compared\n");
        problems++;
    }
    kt_st_close(ref);
    kt_st_close(out);
    return problems == 0 ? 0 : 1;
}
