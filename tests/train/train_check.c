/* The kt-train test's helper (tests/train/run_train_tests.sh): writes token files and compares
 * what the runs wrote.
 *
 *   train_check tokens OUT N VOCAB PATTERN [BAD_AT]
 *       N u16 token ids below VOCAB: PATTERN "markov" (each token a fixed function of the
 *       one before, plus a pseudo-random 0..3: learnable but not trivially), or "repeat" (a
 *       period-11 sequence, for the loss-decrease check); token BAD_AT, if given, is VOCAB
 *       (out of range, for the error case)
 *   train_check losses A B TOL
 *       the files have the same number of lines and every loss of A equals B's within TOL,
 *       relative: |a - b| <= TOL * |b|
 *   train_check params A.safetensors B.safetensors TOL
 *   train_check select IN.safetensors OUT.safetensors PREFIX
 *       the same tensors (names, dtypes, shapes), each of A equal to B's within TOL relative
 *       to B's largest magnitude: max |a - b| / max |b| (tests/comm/cp_rank_test.c's measure)
 *   train_check shards B.safetensors TOL A1.safetensors A2...
 *       the files one expert-parallel run saved (each rank's: the replicated parameters and
 *       its share of the experts) against one rank's B: every tensor of B is in at least one
 *       A, every tensor of an A is B's, each within TOL as for params
 *   train_check decrease LOSSES RATIO
 *       the last loss is below RATIO times the first
 *
 * Prints "ok: ..." or "FAIL: ..."; exit 0 ok, 1 failed, 2 usage or read error. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kt/kt.h>

static int tokens(const char *path, long n, long vocab, const char *pattern, long bad_at)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL) {
        perror(path);
        return 2;
    }
    uint64_t x = 12345;
    long t = 0;
    for (long i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        if (strcmp(pattern, "repeat") == 0)
            t = (i % 11) * 5 % vocab;
        else
            t = (t * 5 + 3 + (long)(x >> 62)) % vocab;
        long v = i == bad_at ? vocab : t;
        unsigned char b[2] = {(unsigned char)(v & 0xff), (unsigned char)(v >> 8)};
        fwrite(b, 1, 2, f);
    }
    return fclose(f) == 0 ? 0 : 2;
}

static int read_losses(const char *path, double *v, int cap)
{
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        perror(path);
        return -1;
    }
    int n = 0;
    while (n < cap && fscanf(f, "%lf", &v[n]) == 1)
        n++;
    fclose(f);
    return n;
}

static int losses(const char *a, const char *b, double tol)
{
    double x[4096], y[4096];
    int n = read_losses(a, x, 4096), m = read_losses(b, y, 4096);
    if (n < 0 || m < 0)
        return 2;
    if (n != m || n == 0) {
        printf("FAIL: %s has %d losses, %s has %d\n", a, n, b, m);
        return 1;
    }
    double worst = 0;
    int at = 0;
    for (int i = 0; i < n; i++) {
        double e = fabs(x[i] - y[i]) / fmax(fabs(y[i]), 1e-30);
        if (!(e <= worst)) {
            worst = e;
            at = i;
        }
    }
    int ok = worst <= tol;
    printf("%s: %d losses, largest relative difference %.3g (step %d: %.9g vs %.9g), "
           "tolerance %.3g\n", ok ? "ok" : "FAIL", n, worst, at + 1, x[at], y[at], tol);
    return ok ? 0 : 1;
}

static int decrease(const char *path, double ratio)
{
    double v[4096];
    int n = read_losses(path, v, 4096);
    if (n < 2) {
        printf("FAIL: %s has %d losses\n", path, n);
        return 1;
    }
    int ok = v[n - 1] < ratio * v[0];
    printf("%s: loss %.4f at step 1, %.4f at step %d (must be below %.2f x the first)\n",
           ok ? "ok" : "FAIL", v[0], v[n - 1], n, ratio);
    return ok ? 0 : 1;
}

/* The tensor as doubles (the parameter dtypes f32, bf16 and f16, and the integers i32 and i64:
 * a quantized layer's codes), or NULL. */
static double *as_doubles(const kt_st_file *f, const char *name, int64_t *n_out)
{
    kt_tensor view, dst;
    if (kt_st_find(f, name, &view) != KT_OK)
        return NULL;
    int64_t n = kt_tensor_numel(&view);
    void *raw = malloc(kt_tensor_nbytes(&view) + 1);
    double *out = malloc(sizeof(double) * (size_t)(n + 1));
    if (raw == NULL || out == NULL ||
        kt_tensor_init(&dst, raw, view.dtype, view.ndim, view.shape) != KT_OK ||
        kt_st_read(f, name, &dst) != KT_OK) {
        free(raw);
        free(out);
        return NULL;
    }
    for (int64_t i = 0; i < n; i++) {
        const int half = view.dtype == KT_BF16 || view.dtype == KT_F16;
        const uint16_t h = half ? ((const uint16_t *)raw)[i] : 0;
        out[i] = view.dtype == KT_F32  ? ((const float *)raw)[i]
               : view.dtype == KT_BF16 ? kt_bf16_to_f32_1(h)
               : view.dtype == KT_F16  ? kt_f16_to_f32_1(h)
               : view.dtype == KT_I32  ? (double)((const int32_t *)raw)[i]
               : view.dtype == KT_I64  ? (double)((const int64_t *)raw)[i]
                                       : NAN;
    }
    free(raw);
    *n_out = n;
    return out;
}

/* max |a - b| / max |b| over one tensor; -1 when it cannot be compared. */
static double tensor_diff(const kt_st_file *a, const kt_st_file *b, const char *name)
{
    kt_tensor va, vb;
    if (kt_st_find(a, name, &va) != KT_OK || kt_st_find(b, name, &vb) != KT_OK ||
        va.dtype != vb.dtype || !kt_tensor_same_shape(&va, &vb))
        return -1;
    int64_t n = 0;
    double *x = as_doubles(a, name, &n), *y = as_doubles(b, name, &n), scale = 1e-30, err = 0;
    if (x == NULL || y == NULL) {
        free(x);
        free(y);
        return -1;
    }
    for (int64_t k = 0; k < n; k++) {
        scale = fmax(scale, fabs(y[k]));
        err = isnan(x[k] - y[k]) ? INFINITY : fmax(err, fabs(x[k] - y[k]));
    }
    free(x);
    free(y);
    return err / scale;
}

static int params(const char *pa, const char *pb, double tol)
{
    kt_st_file *a = NULL, *b = NULL;
    if (kt_st_open(pa, &a) != KT_OK || kt_st_open(pb, &b) != KT_OK) {
        fprintf(stderr, "train_check: %s\n", kt_last_error());
        return 2;
    }
    int rc = 0;
    double worst = 0;
    const char *worst_name = "";
    if (kt_st_count(a) != kt_st_count(b)) {
        printf("FAIL: %s has %zu tensors, %s has %zu\n", pa, kt_st_count(a), pb, kt_st_count(b));
        rc = 1;
    }
    for (size_t i = 0; i < kt_st_count(a) && rc == 0; i++) {
        const char *name;
        kt_tensor view;
        kt_st_entry(a, i, &name, &view);
        double e = tensor_diff(a, b, name);
        if (e < 0) {
            printf("FAIL: tensor '%s' of %s is missing from %s, or differs in dtype or shape\n",
                   name, pa, pb);
            rc = 1;
        } else if (e > worst) {
            worst = e;
            worst_name = name;
        }
    }
    if (rc == 0) {
        rc = worst <= tol ? 0 : 1;
        printf("%s: %zu tensors, largest relative difference %.3g (tensor '%s'), tolerance "
               "%.3g\n", rc == 0 ? "ok" : "FAIL", kt_st_count(a), worst,
               worst > 0 ? worst_name : "all equal", tol);
    }
    kt_st_close(a);
    kt_st_close(b);
    return rc;
}

static int shards(const char *pb, double tol, char **pa, int n)
{
    kt_st_file *b = NULL;
    if (kt_st_open(pb, &b) != KT_OK) {
        fprintf(stderr, "train_check: %s\n", kt_last_error());
        return 2;
    }
    char *seen = calloc(kt_st_count(b) + 1, 1);
    int rc = seen == NULL ? 2 : 0;
    double worst = 0;
    for (int f = 0; f < n && rc == 0; f++) {
        kt_st_file *a = NULL;
        if (kt_st_open(pa[f], &a) != KT_OK) {
            fprintf(stderr, "train_check: %s\n", kt_last_error());
            rc = 2;
            break;
        }
        for (size_t i = 0; i < kt_st_count(a) && rc == 0; i++) {
            const char *name;
            kt_tensor view;
            kt_st_entry(a, i, &name, &view);
            double e = tensor_diff(a, b, name);
            if (e < 0) {
                printf("FAIL: tensor '%s' of %s is missing from %s, or differs in dtype or "
                       "shape\n", name, pa[f], pb);
                rc = 1;
            } else if (e > tol) {
                printf("FAIL: tensor '%s' of %s differs from %s's by %.3g (tolerance %.3g)\n",
                       name, pa[f], pb, e, tol);
                rc = 1;
            }
            worst = e > worst ? e : worst;
            for (size_t j = 0; j < kt_st_count(b); j++) {
                const char *bn;
                kt_st_entry(b, j, &bn, &view);
                seen[j] |= strcmp(bn, name) == 0;
            }
        }
        kt_st_close(a);
    }
    for (size_t j = 0; j < kt_st_count(b) && rc == 0; j++) {
        const char *bn;
        kt_tensor view;
        kt_st_entry(b, j, &bn, &view);
        if (!seen[j]) {
            printf("FAIL: tensor '%s' of %s is in none of the %d shards\n", bn, pb, n);
            rc = 1;
        }
    }
    if (rc == 0)
        printf("ok: %zu tensors in %d shards, largest relative difference %.3g, tolerance "
               "%.3g\n", kt_st_count(b), n, worst, tol);
    free(seen);
    kt_st_close(b);
    return rc;
}

/* The tensors of IN whose names start with PREFIX, into OUT (an experts-only file made from
 * a file kt-train --save wrote). */
static int select_prefix(const char *in, const char *out, const char *prefix)
{
    kt_st_file *f = NULL;
    if (kt_st_open(in, &f) != KT_OK) {
        fprintf(stderr, "train_check: %s\n", kt_last_error());
        return 2;
    }
    kt_st_item *items = calloc(kt_st_count(f) + 1, sizeof *items);
    size_t n = 0;
    for (size_t i = 0; items != NULL && i < kt_st_count(f); i++) {
        kt_st_entry(f, i, &items[n].name, &items[n].tensor);
        n += strncmp(items[n].name, prefix, strlen(prefix)) == 0;
    }
    int rc = items == NULL || n == 0 || kt_st_save(out, items, n, NULL) != KT_OK;
    if (rc)
        fprintf(stderr, "train_check: no '%s' tensors in %s, or %s\n", prefix, in,
                kt_last_error());
    free(items);
    kt_st_close(f);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc == 5 && strcmp(argv[1], "select") == 0)
        return select_prefix(argv[2], argv[3], argv[4]);
    if (argc >= 6 && strcmp(argv[1], "tokens") == 0)
        return tokens(argv[2], atol(argv[3]), atol(argv[4]), argv[5],
                      argc > 6 ? atol(argv[6]) : -1);
    if (argc == 5 && strcmp(argv[1], "losses") == 0)
        return losses(argv[2], argv[3], atof(argv[4]));
    if (argc == 5 && strcmp(argv[1], "params") == 0)
        return params(argv[2], argv[3], atof(argv[4]));
    if (argc >= 5 && strcmp(argv[1], "shards") == 0)
        return shards(argv[2], atof(argv[3]), argv + 4, argc - 4);
    if (argc == 4 && strcmp(argv[1], "decrease") == 0)
        return decrease(argv[2], atof(argv[3]));
    fprintf(stderr, "usage: train_check tokens OUT N VOCAB markov|repeat [BAD_AT]\n"
                    "       train_check losses A B TOL | params A B TOL | decrease LOSSES RATIO\n"
                    "       train_check shards B TOL A1 A2...\n"
                    "       train_check select IN OUT PREFIX\n");
    return 2;
}
