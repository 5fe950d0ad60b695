/* The training data: a flat binary file of token ids (u8, u16 or i32, little-endian, as
 * llm.c writes them; u8 makes any text file a byte-level corpus).
 *
 * Step s reads the window of T + 1 tokens starting at token s * T, wrapping around the end
 * of the file, where T is the number of tokens one step consumes over all ranks. The tokens
 * input gets the first T, the targets input the same window shifted by one, and a labels input
 * (transformers' convention, as kt-import's programs take them: the program shifts the labels
 * itself with shift_labels) the same T tokens as the token input. Each input is
 * filled as if it held the whole window (row-major in its global shape, the shard dimension
 * W times longer) and every rank keeps its own slice along the shard dimension: for the 1-D
 * token inputs of examples/lm.ktg, rank r gets tokens [r T/W, (r+1) T/W). Every rank checks
 * every id of the file before the first step (and each window again as it reads it), so a bad
 * token id stops every rank, before any work, with the same message. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tools/kt-train/train.h"

/* ---- the program side: which inputs get tokens, and their shapes over all ranks ---------- */

static int find_input(const kt_program *p, const char *name)
{
    for (int i = 0; i < kt_program_count(p, KT_ROLE_INPUT); i++) {
        const char *n;
        if (kt_program_tensor_info(p, KT_ROLE_INPUT, i, &n, NULL) == KT_OK && strcmp(n, name) == 0)
            return i;
    }
    return -1;
}

/* The input's shape and dtype from the program (no session yet: the file is checked before
 * any memory is committed); data_bind points the view at the session's tensor. */
static int describe_feed(feed *f, const char *name, int shift, const kt_program *p,
                         const ranks *r)
{
    f->name = name;
    f->shift = shift;
    for (int i = 0; i < kt_program_count(p, KT_ROLE_INPUT); i++) {
        const char *n;
        if (kt_program_tensor_info(p, KT_ROLE_INPUT, i, &n, &f->view) == KT_OK &&
            strcmp(n, name) == 0)
            break;
    }
    if (kt_program_shard_dim(p, name, &f->shard_dim) != KT_OK)
        return train_fail("cannot read a program input", kt_last_error());
    if (f->view.dtype != KT_I32 && f->view.dtype != KT_I64) {
        train_error("program input '%s' is %s; token ids need i32 or i64", name,
                    kt_dtype_name(f->view.dtype));
        return 1;
    }
    if (f->shard_dim >= f->view.ndim) {
        train_error("program input '%s' is sharded along dimension %d, but has %d",
                    name, f->shard_dim, f->view.ndim);
        return 1;
    }
    for (int k = 0; k < f->view.ndim; k++)
        f->global[k] = f->view.shape[k] * (k == f->shard_dim ? r->world : 1);
    return 0;
}

static int64_t global_numel(const feed *f)
{
    int64_t n = 1;
    for (int k = 0; k < f->view.ndim; k++)
        n *= f->global[k];
    return n;
}

/* Every program input is a token input kt-train feeds: no other data source exists. */
static int check_inputs_fed(const token_data *d, const train_args *a, const kt_program *p)
{
    for (int i = 0; i < kt_program_count(p, KT_ROLE_INPUT); i++) {
        const char *name;
        kt_program_tensor_info(p, KT_ROLE_INPUT, i, &name, NULL);
        int fed = 0;
        for (int k = 0; k < d->n_feeds; k++)
            fed |= strcmp(d->feeds[k].name, name) == 0;
        if (!fed) {
            train_error("the program takes input '%s', which kt-train cannot feed: "
                        "it feeds token ids to '%s' and '%s' and the next tokens to '%s' "
                        "(see --input-tokens, --input-labels, --input-targets)", name,
                        d->feeds[0].name, a->labels_input, a->targets_input);
            return 1;
        }
    }
    return 0;
}

static int describe_inputs(token_data *d, const train_args *a, const kt_program *p,
                           const ranks *r)
{
    /* kt-import's programs name the token input as transformers does */
    const char *tokens = a->tokens_input;
    if (!a->tokens_input_set && find_input(p, tokens) < 0 && find_input(p, "input_ids") >= 0)
        tokens = "input_ids";
    if (find_input(p, tokens) < 0) {
        train_error("%s has no input named '%s' (the token ids; see "
                    "--input-tokens)", a->program, tokens);
        return 1;
    }
    if (describe_feed(&d->feeds[0], tokens, 0, p, r) != 0)
        return 1;
    d->n_feeds = 1;
    if (find_input(p, a->targets_input) >= 0) {
        if (describe_feed(&d->feeds[1], a->targets_input, 1, p, r) != 0)
            return 1;
        d->n_feeds = 2;
    }
    if (find_input(p, a->labels_input) >= 0) {
        if (describe_feed(&d->feeds[d->n_feeds], a->labels_input, 0, p, r) != 0)
            return 1;
        d->n_feeds++;
    }
    if (check_inputs_fed(d, a, p) != 0)
        return 1;
    /* unsharded, every rank would get the whole window: the same tokens W times (and a halo
     * op would put copies of the window's ends in front of each other) */
    int sharded = 0;
    for (int k = 0; k < d->n_feeds; k++)
        sharded |= d->feeds[k].shard_dim >= 0;
    if (r->world > 1 && !sharded)
        return train_error("%s shards none of its token inputs, so each of the %d ranks would "
                           "train on the same window: compile it with 'shard %s dim D' (the "
                           "time dimension)", a->program, r->world, tokens);
    d->window = global_numel(&d->feeds[0]);
    for (int k = 1; k < d->n_feeds; k++)
        if (global_numel(&d->feeds[k]) != d->window) {
            train_error("input '%s' takes %lld tokens per step over %d rank%s, but "
                        "'%s' takes %lld: they must be the same window", d->feeds[k].name,
                        (long long)global_numel(&d->feeds[k]), r->world,
                        r->world == 1 ? "" : "s", d->feeds[0].name, (long long)d->window);
            return 1;
        }
    /* the ids must fit every op that reads them as indices */
    d->bound = -1;
    for (int k = 0; k < d->n_feeds; k++) {
        int64_t b;
        if (kt_program_index_bound(p, d->feeds[k].name, &b) != KT_OK)
            return train_fail("cannot read the program's vocabulary", kt_last_error());
        if (b >= 0 && (d->bound < 0 || b < d->bound))
            d->bound = b;
    }
    return 0;
}

/* ---- the file side ------------------------------------------------------------------------ */

static int open_file(token_data *d, const char *path, const train_args *a)
{
    d->path = path;
    d->token_bytes = a->token_bytes;
    d->header = a->data_header;
    int fd = -1;
    struct stat st;
    if (kt_in_open(path, &fd, NULL) != KT_OK)
        return train_fail("cannot open the data file", kt_last_error());
    if ((d->file = fdopen(fd, "rb")) == NULL || fstat(fd, &st) != 0) {
        train_error("cannot open the data file %s: %s", path, strerror(errno));
        if (d->file == NULL)
            close(fd);
        return 1;
    }
    if (!S_ISREG(st.st_mode)) { /* a pipe: the windows are read at offsets */
        train_error("the data file %s is not a regular file (a pipe?)", path);
        return 1;
    }
    int64_t payload = (int64_t)st.st_size - d->header;
    if (payload < 0) {
        train_error("--data-header %lld is larger than %s (%lld bytes)",
                    (long long)d->header, path, (long long)st.st_size);
        return 1;
    }
    if (payload % d->token_bytes != 0) {
        train_error("%s: %lld bytes%s are not a whole number of %d-byte tokens "
                    "(wrong --data-format?)", path, (long long)payload,
                    d->header ? " after the header" : "", d->token_bytes);
        return 1;
    }
    d->n_tokens = payload / d->token_bytes;
    if (d->n_tokens < d->window + 1) {
        train_error("%s holds %lld tokens; one step needs %lld (a window of %lld "
                    "tokens and the next one for the targets)", path, (long long)d->n_tokens,
                    (long long)d->window + 1, (long long)d->window);
        return 1;
    }
    return 0;
}

static int read_run(token_data *d, int64_t first, int64_t n, int64_t *out);
static int bad_id(const token_data *d, int64_t at, int64_t v);

/* Every token of the file checked once before the first step, so that a bad id stops the run
 * before any work rather than hours in, when a window first reaches it. */
static int check_all_ids(token_data *d)
{
    enum { RUN = 1 << 16 };
    int64_t *ids = malloc(sizeof *ids * RUN);
    if (ids == NULL)
        return train_fail("out of memory checking the data", NULL);
    int failed = 0;
    d->content_hash = 0xcbf29ce484222325ull; /* FNV-1a over the ids, for the same-run check */
    for (int64_t first = 0; first < d->n_tokens && !failed; first += RUN) {
        const int64_t n = d->n_tokens - first < RUN ? d->n_tokens - first : RUN;
        failed = read_run(d, first, n, ids);
        for (int64_t i = 0; i < n && !failed; i++) {
            failed = bad_id(d, first + i, ids[i]);
            d->content_hash = (d->content_hash ^ (uint64_t)ids[i]) * 0x100000001b3ull;
        }
    }
    free(ids);
    return failed;
}

int data_open(token_data *d, const char *path, const train_args *a, const kt_program *p,
              const ranks *r)
{
    memset(d, 0, sizeof *d);
    if (describe_inputs(d, a, p, r) != 0 || open_file(d, path, a) != 0 || check_all_ids(d) != 0)
        return 1;
    d->buf = malloc(sizeof *d->buf * (size_t)(d->window + 1));
    if (d->buf == NULL)
        return train_fail("out of memory for the token window", NULL);
    return 0;
}

int data_bind(token_data *d, kt_session *s)
{
    for (int k = 0; k < d->n_feeds; k++)
        if (kt_session_tensor(s, KT_ROLE_INPUT, d->feeds[k].name, &d->feeds[k].view) != KT_OK)
            return train_fail("cannot bind a program input", kt_last_error());
    return 0;
}

void data_close(token_data *d)
{
    if (d->file != NULL)
        fclose(d->file);
    free(d->buf);
    memset(d, 0, sizeof *d);
}

/* Little-endian token `i` of a raw block. */
static int64_t token_at(const unsigned char *raw, int bytes, int64_t i)
{
    const unsigned char *b = raw + i * bytes;
    if (bytes == 1)
        return b[0];
    if (bytes == 2)
        return (int64_t)b[0] | (int64_t)b[1] << 8;
    uint32_t u = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    return (int32_t)u; /* i32: negative ids are read as such, and refused below */
}

/* n tokens from token position `first` (no wrap) into out. */
static int read_run(token_data *d, int64_t first, int64_t n, int64_t *out)
{
    unsigned char chunk[4096];
    int64_t per = (int64_t)sizeof chunk / d->token_bytes;
    if (fseeko(d->file, (off_t)(d->header + first * d->token_bytes), SEEK_SET) != 0)
        goto io_error;
    for (int64_t done = 0; done < n;) {
        int64_t m = n - done < per ? n - done : per;
        if (fread(chunk, (size_t)d->token_bytes, (size_t)m, d->file) != (size_t)m)
            goto io_error;
        for (int64_t i = 0; i < m; i++)
            out[done + i] = token_at(chunk, d->token_bytes, i);
        done += m;
    }
    return 0;
io_error:
    train_error("cannot read %s at token %lld: %s", d->path, (long long)first,
                ferror(d->file) ? strerror(errno) : "the file is shorter than it was");
    return 1;
}

/* Whether id v fits the model; if not, says which token of the file it is (1). */
static int bad_id(const token_data *d, int64_t at, int64_t v)
{
    if (v >= 0 && (d->bound < 0 || v < d->bound))
        return 0;
    char range[64] = "";
    if (d->bound >= 0)
        snprintf(range, sizeof range, ", outside the model's vocabulary [0, %lld)",
                 (long long)d->bound);
    train_error("%s: token %lld (byte offset %lld) is %lld%s", d->path,
                (long long)at, (long long)(d->header + at * d->token_bytes), (long long)v,
                d->bound >= 0 ? range : ", a negative id");
    return 1;
}

/* The window just read (its ids were all checked at open; checked again in case the file
 * changed under the run). */
static int check_ids(const token_data *d, int64_t start)
{
    for (int64_t i = 0; i <= d->window; i++)
        if (bad_id(d, (start + i) % d->n_tokens, d->buf[i]))
            return 1;
    return 0;
}

/* This rank's elements of one input, taken from the window as if the input held it whole. */
static void fill_feed(const feed *f, const int64_t *window, const ranks *r)
{
    const kt_tensor *t = &f->view;
    int64_t n = kt_tensor_numel(t), idx[KT_MAX_DIMS] = {0};
    for (int64_t i = 0; i < n; i++) {
        int64_t g = 0; /* the flat index in the global shape */
        for (int k = 0; k < t->ndim; k++) {
            int64_t at = idx[k] + (k == f->shard_dim ? (int64_t)r->rank * t->shape[k] : 0);
            g = g * f->global[k] + at;
        }
        int64_t v = window[f->shift + g];
        if (t->dtype == KT_I32)
            ((int32_t *)t->data)[i] = (int32_t)v;
        else
            ((int64_t *)t->data)[i] = v;
        for (int k = t->ndim - 1; k >= 0 && ++idx[k] == t->shape[k]; k--)
            idx[k] = 0; /* the next row-major index */
    }
}

/* a * b mod m without overflow, for any step count and file size */
static int64_t mul_mod(int64_t a, int64_t b, int64_t m)
{
    uint64_t r = 0, x = (uint64_t)(a % m), y = (uint64_t)(b % m), um = (uint64_t)m;
    for (; y > 0; y >>= 1) {
        if (y & 1)
            r = r >= um - x ? r - (um - x) : r + x;
        x = x >= um - x ? x - (um - x) : x + x;
    }
    return (int64_t)r;
}

int data_load_step(token_data *d, int64_t step, const ranks *r)
{
    int64_t start = mul_mod(step, d->window, d->n_tokens);
    int64_t need = d->window + 1, first = d->n_tokens - start < need ? d->n_tokens - start : need;
    if (read_run(d, start, first, d->buf) != 0 ||
        (first < need && read_run(d, 0, need - first, d->buf + first) != 0))
        return 1;
    if (check_ids(d, start) != 0)
        return 1;
    for (int k = 0; k < d->n_feeds; k++)
        fill_feed(&d->feeds[k], d->buf, r);
    return 0;
}

int64_t data_windows(const token_data *d)
{
    return (d->n_tokens - 1) / d->window;
}

double data_bytes_per_token(const token_data *d)
{
    return d->token_bytes == 1 ? 1.0 : 0.0;
}

/* Counts of each id over the whole file into counts[0, v). */
static int count_ids(token_data *d, int64_t *counts, int64_t v)
{
    enum { RUN = 1 << 16 };
    int64_t *ids = malloc(sizeof *ids * RUN);
    if (ids == NULL)
        return train_fail("out of memory counting the tokens", NULL);
    int failed = 0;
    for (int64_t first = 0; first < d->n_tokens && !failed; first += RUN) {
        const int64_t n = d->n_tokens - first < RUN ? d->n_tokens - first : RUN;
        failed = read_run(d, first, n, ids);
        for (int64_t i = 0; i < n && !failed; i++)
            if (ids[i] >= 0 && ids[i] < v)
                counts[ids[i]]++;
    }
    free(ids);
    return failed;
}

/* The largest id of the file plus one (the ids were checked non-negative at open). */
static int id_span(token_data *d, int64_t *span)
{
    enum { RUN = 1 << 16 };
    int64_t *ids = malloc(sizeof *ids * RUN);
    if (ids == NULL)
        return train_fail("out of memory counting the tokens", NULL);
    int failed = 0;
    for (int64_t first = 0; first < d->n_tokens && !failed; first += RUN) {
        const int64_t n = d->n_tokens - first < RUN ? d->n_tokens - first : RUN;
        failed = read_run(d, first, n, ids);
        for (int64_t i = 0; i < n && !failed; i++)
            if (ids[i] + 1 > *span)
                *span = ids[i] + 1;
    }
    free(ids);
    return failed;
}

int data_unigram_loss(token_data *train, token_data *heldout, double *nats_out)
{
    int64_t v = train->bound;
    if (v < 0) {
        v = 0;
        if (id_span(train, &v) != 0 || id_span(heldout, &v) != 0)
            return 1;
    }
    int64_t *counts = calloc((size_t)v, sizeof *counts);
    if (counts == NULL)
        return train_fail("out of memory for the unigram counts", NULL);
    int failed = count_ids(train, counts, v);
    double total = (double)train->n_tokens + (double)v, sum = 0;
    int64_t predicted = 0;
    /* the held-out windows' predicted tokens: each window's tokens after its first */
    for (int64_t w = 0; w < data_windows(heldout) && !failed; w++) {
        failed = read_run(heldout, w * heldout->window + 1, heldout->window, heldout->buf);
        for (int64_t i = 0; i < heldout->window && !failed; i++) {
            int64_t id = heldout->buf[i];
            double c = id >= 0 && id < v ? (double)counts[id] : 0.0;
            sum -= log((c + 1.0) / total);
            predicted++;
        }
    }
    free(counts);
    if (failed)
        return 1;
    *nats_out = predicted > 0 ? sum / (double)predicted : NAN;
    return 0;
}
