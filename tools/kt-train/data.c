/* The training data: a flat binary file of token ids (u8, u16 or i32, little-endian, as
 * llm.c writes them; u8 makes any text file a byte-level corpus), or kt-data's prepared file
 * (prepared.c: the tokens, a loss mask and each token's document).
 *
 * Step s reads the window of T + 1 tokens starting at token s * T, wrapping around the end
 * of the file, where T is the number of tokens one step consumes over all ranks. The tokens
 * input gets the first T, the targets input the same window shifted by one, and a labels input
 * (transformers' convention, as kt-import's programs take them: the program shifts the labels
 * itself with shift_labels) the same T tokens as the token input. In a prepared file a target
 * that does not count (loss mask 0) or that starts another document is -100 (cross_entropy's
 * ignore_index), in both; a `segments` input gets, per row of its shape, the document
 * number within the row (attention(q, k, v, segments) never attends across them). A flat file
 * is one document whose targets all count. Each input is
 * filled as if it held the whole window (row-major in its global shape, the shard dimension
 * W times longer) and every rank keeps its own part along the shard dimension: for the 1-D
 * token inputs of examples/lm.ktg, rank r gets tokens [r T/W, (r+1) T/W); for a program with
 * cp_attention in the balanced layout, chunks r and 2W-1-r of 2W (examples/cp_lm.ktg). A
 * `positions` input gets each token's position in its row (rope at global positions). Every rank checks
 * every id of the file before the first step (and each window again as it reads it), so a bad
 * token id stops every rank, before any work, with the same message. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tools/kt-train/train.h"

/* the program inputs that get the segment ids (as examples/moe_lm.ktg names it) and the
 * positions (rope's, as examples/cp_lm.ktg names it) */
#define SEGMENTS_INPUT "segments"
#define POSITIONS_INPUT "positions"

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
static int describe_feed(feed *f, const char *name, feed_kind kind, const kt_program *p,
                         const ranks *r, kt_cp_layout layout)
{
    f->name = name;
    f->kind = kind;
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
    f->balanced = f->shard_dim >= 0 && layout == KT_CP_BALANCED;
    if (f->balanced && f->view.shape[f->shard_dim] % 2 != 0) {
        train_error("program input '%s' is sharded along dimension %d in cp_attention's "
                    "balanced layout (two chunks a rank), but this rank's part has %lld "
                    "positions there, an odd number", name, f->shard_dim,
                    (long long)f->view.shape[f->shard_dim]);
        return 1;
    }
    return 0;
}

/* The global index along a sharded dimension of this rank's index i (of n there). */
static int64_t shard_index(const feed *f, const ranks *r, int64_t n, int64_t i)
{
    if (!f->balanced)
        return (int64_t)r->rank * n + i;
    const int64_t c = n / 2, chunk = i < c ? r->rank : 2 * (int64_t)r->world - 1 - r->rank;
    return chunk * c + i % c;
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
                        "it feeds token ids to '%s' and '%s', the next tokens to '%s', "
                        "document numbers to 'segments' and positions to 'positions' (see "
                        "--input-tokens, --input-labels, --input-targets)", name,
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
    kt_cp_layout layout;
    if (kt_program_cp_layout(p, &layout) != KT_OK)
        return train_fail("cannot read the program's context-parallel layout", kt_last_error());
    if (describe_feed(&d->feeds[0], tokens, FEED_TOKENS, p, r, layout) != 0)
        return 1;
    d->n_feeds = 1;
    const char *others[4] = {a->targets_input, a->labels_input, SEGMENTS_INPUT,
                             POSITIONS_INPUT};
    const feed_kind kinds[4] = {FEED_TARGETS, FEED_LABELS, FEED_SEGMENTS, FEED_POSITIONS};
    for (int k = 0; k < 4; k++)
        if (find_input(p, others[k]) >= 0) {
            if (describe_feed(&d->feeds[d->n_feeds], others[k], kinds[k], p, r, layout) != 0)
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
    /* the ids must fit every op that reads them as indices (segments and positions are not
     * ids; positions must fit rope's table) */
    d->bound = -1;
    for (int k = 0; k < d->n_feeds; k++) {
        const feed *f = &d->feeds[k];
        if (f->kind == FEED_SEGMENTS)
            continue;
        int64_t b;
        if (kt_program_index_bound(p, f->name, &b) != KT_OK)
            return train_fail("cannot read the program's vocabulary", kt_last_error());
        if (f->kind == FEED_POSITIONS) {
            const int64_t row = f->view.ndim > 0 ? f->global[f->view.ndim - 1] : 1;
            if (b >= 0 && row > b)
                return train_error("input '%s' gets positions 0..%lld, but the program's rope "
                                   "takes positions below %lld (its max_positions)", f->name,
                                   (long long)row - 1, (long long)b);
            continue;
        }
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
    if (prepared_detect(d->file, (int64_t)st.st_size, &d->prepared) != 0)
        return 1;
    if (d->prepared) {
        if (d->header != 0)
            return train_error("%s is a prepared token file (kt-data's); --data-header is for "
                               "flat token files", path);
        if (prepared_open(d) != 0)
            return 1;
    } else {
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
    }
    if (d->n_tokens < d->window + 1) {
        train_error("%s holds %lld tokens; one step needs %lld (a window of %lld "
                    "tokens and the next one for the targets)", path, (long long)d->n_tokens,
                    (long long)d->window + 1, (long long)d->window);
        return 1;
    }
    return 0;
}

/* What is read from the file: a prepared file's three tensors, a flat file's tokens only. */
typedef enum column { COL_TOKENS, COL_MASK, COL_DOCS } column;

static int read_run(token_data *d, column c, int64_t first, int64_t n, int64_t *out);
static int bad_id(const token_data *d, int64_t at, int64_t v);

static int64_t *run_buffer(int64_t **ids, int64_t **mask, int64_t **docs, int64_t n)
{
    *ids = malloc(sizeof **ids * (size_t)n * 3);
    *mask = *ids ? *ids + n : NULL;
    *docs = *ids ? *ids + 2 * n : NULL;
    return *ids;
}

/* A prepared file's mask and documents at token `at`: masks 0 or 1, documents from 0 on,
 * never decreasing; counts the documents. */
static int check_mask_docs(token_data *d, int64_t at, int64_t mask, int64_t doc, int64_t *prev)
{
    if (mask != 0 && mask != 1)
        return train_error("%s: loss_mask[%lld] is %lld; a mask holds 0 or 1", d->path,
                           (long long)at, (long long)mask);
    if (doc < 0 || doc < *prev)
        return train_error("%s: doc_index[%lld] is %lld after %lld: the document indices must "
                           "start at 0 or more and never decrease", d->path, (long long)at,
                           (long long)doc, (long long)*prev);
    d->n_docs += at == 0 || doc != *prev;
    *prev = doc;
    return 0;
}

/* Every token of the file checked once before the first step, so that a bad id stops the run
 * before any work rather than hours in, when a window first reaches it. */
static int check_all_ids(token_data *d)
{
    enum { RUN = 1 << 16 };
    int64_t *ids, *mask, *docs, prev = 0;
    if (run_buffer(&ids, &mask, &docs, RUN) == NULL)
        return train_fail("out of memory checking the data", NULL);
    int failed = 0;
    d->content_hash = 0xcbf29ce484222325ull; /* FNV-1a over the ids, for the same-run check */
    d->n_docs = d->prepared ? 0 : 1;
    for (int64_t first = 0; first < d->n_tokens && !failed; first += RUN) {
        const int64_t n = d->n_tokens - first < RUN ? d->n_tokens - first : RUN;
        failed = read_run(d, COL_TOKENS, first, n, ids) ||
                 (d->prepared && (read_run(d, COL_MASK, first, n, mask) ||
                                  read_run(d, COL_DOCS, first, n, docs)));
        for (int64_t i = 0; i < n && !failed; i++) {
            failed = bad_id(d, first + i, ids[i]) ||
                     (d->prepared && check_mask_docs(d, first + i, mask[i], docs[i], &prev));
            d->content_hash = (d->content_hash ^ (uint64_t)ids[i]) * 0x100000001b3ull;
            if (d->prepared) /* the same ids with another mask or split are another run */
                d->content_hash = (d->content_hash ^ ((uint64_t)mask[i] | (uint64_t)docs[i] << 1)) *
                                  0x100000001b3ull;
        }
    }
    free(ids);
    return failed;
}

static int find_feed(const token_data *d, feed_kind kind)
{
    for (int k = 0; k < d->n_feeds; k++)
        if (d->feeds[k].kind == kind)
            return k;
    return -1;
}

/* Documents packed into one window would see each other through an attention that is not
 * given their segments: refused unless asked for. */
static int check_cross_document(const token_data *d, const train_args *a)
{
    if (d->n_docs <= 1 || find_feed(d, FEED_SEGMENTS) >= 0 || a->allow_cross_document)
        return 0;
    return train_error("%s holds %lld documents packed together, but %s has no '%s' input: "
                       "its attention would attend across documents within a window. Add "
                       "'input %s: i32[B, T]' to the model and pass it to every attention "
                       "(attention(q, k, v, %s)), or give --allow-cross-document to train so "
                       "anyway (the targets still never cross a document)", d->path,
                       (long long)d->n_docs, a->program, SEGMENTS_INPUT, SEGMENTS_INPUT,
                       SEGMENTS_INPUT);
}

int data_open(token_data *d, const char *path, const train_args *a, const kt_program *p,
              const ranks *r)
{
    memset(d, 0, sizeof *d);
    if (describe_inputs(d, a, p, r) != 0 || open_file(d, path, a) != 0 ||
        check_all_ids(d) != 0 || check_cross_document(d, a) != 0)
        return 1;
    const size_t n = (size_t)d->window + 2;
    d->buf = malloc(sizeof *d->buf * n);
    d->docs = malloc(sizeof *d->docs * n);
    d->values = malloc(sizeof *d->values * n);
    d->mask = malloc(n);
    d->starts = malloc(n);
    if (!d->buf || !d->docs || !d->values || !d->mask || !d->starts)
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
    free(d->docs);
    free(d->values);
    free(d->mask);
    free(d->starts);
    memset(d, 0, sizeof *d);
}

/* Little-endian element `i` of a raw block: u8, u16, or i32 (read signed: negative ids are
 * read as such, and refused). */
static int64_t element_at(const unsigned char *raw, int bytes, int64_t i)
{
    const unsigned char *b = raw + i * bytes;
    if (bytes == 1)
        return b[0];
    if (bytes == 2)
        return (int64_t)b[0] | (int64_t)b[1] << 8;
    uint32_t u = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    return (int32_t)u;
}

/* n elements of column c from token position `first` (no wrap) into out. */
static int read_run(token_data *d, column c, int64_t first, int64_t n, int64_t *out)
{
    static const char *const names[3] = {"token", "loss_mask value", "doc_index value"};
    const int bytes = c == COL_TOKENS ? d->token_bytes : c == COL_MASK ? 1 : 4;
    const int64_t base = c == COL_TOKENS ? d->header : c == COL_MASK ? d->mask_offset
                                                                      : d->doc_offset;
    unsigned char chunk[4096];
    int64_t per = (int64_t)sizeof chunk / bytes;
    if (fseeko(d->file, (off_t)(base + first * bytes), SEEK_SET) != 0)
        goto io_error;
    for (int64_t done = 0; done < n;) {
        int64_t m = n - done < per ? n - done : per;
        if (fread(chunk, (size_t)bytes, (size_t)m, d->file) != (size_t)m)
            goto io_error;
        for (int64_t i = 0; i < m; i++)
            out[done + i] = element_at(chunk, bytes, i);
        done += m;
    }
    return 0;
io_error:
    train_error("cannot read %s at %s %lld: %s", d->path, names[c], (long long)first,
                ferror(d->file) ? strerror(errno) : "the file is shorter than it was");
    return 1;
}

/* n elements of column c from position `start` on, wrapping around the end of the file. */
static int read_wrapped(token_data *d, column c, int64_t start, int64_t n, int64_t *out)
{
    int64_t first = d->n_tokens - start < n ? d->n_tokens - start : n;
    return read_run(d, c, start, first, out) ||
           (first < n && read_run(d, c, 0, n - first, out + first));
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

/* The window of window + 1 tokens from `start` into buf and, for a prepared file, its mask
 * and where documents start (the file's first token always starts one, also where a window
 * wraps around the end). */
static int load_window(token_data *d, int64_t start)
{
    const int64_t need = d->window + 1;
    if (read_wrapped(d, COL_TOKENS, start, need, d->buf) != 0 || check_ids(d, start) != 0)
        return 1;
    if (!d->prepared)
        return 0;
    const int64_t before = start == 0 ? d->n_tokens - 1 : start - 1;
    if (read_wrapped(d, COL_MASK, start, need, d->values) != 0 ||
        read_wrapped(d, COL_DOCS, before, need + 1, d->docs) != 0)
        return 1;
    for (int64_t i = 0; i < need; i++) {
        d->mask[i] = (unsigned char)(d->values[i] != 0);
        d->starts[i] = (start + i) % d->n_tokens == 0 || d->docs[i + 1] != d->docs[i];
    }
    return 0;
}

/* Whether window token i is a target that counts: masked in, and not a document's first
 * (which nothing before it in the window predicts). */
static int counts(const token_data *d, int64_t i)
{
    return !d->prepared || (d->mask[i] && !d->starts[i]);
}

/* The values input f gets from the loaded window, in the input's global row-major order. */
static void feed_values(token_data *d, const feed *f)
{
    const int64_t row = f->view.ndim > 0 ? f->global[f->view.ndim - 1] : 1;
    int64_t segment = 0;
    for (int64_t g = 0; g < d->window; g++) {
        switch (f->kind) {
        case FEED_TOKENS:
            d->values[g] = d->buf[g];
            break;
        case FEED_TARGETS:
            d->values[g] = counts(d, g + 1) ? d->buf[g + 1] : -100;
            break;
        case FEED_LABELS:
            d->values[g] = counts(d, g) ? d->buf[g] : -100;
            break;
        case FEED_SEGMENTS:
            segment = g % row == 0 ? 0 : segment + (d->prepared && d->starts[g]);
            d->values[g] = segment;
            break;
        case FEED_POSITIONS:
            d->values[g] = g % row;
            break;
        }
    }
}

/* This rank's elements of one input, taken from the window as if the input held it whole. */
static void fill_feed(const feed *f, const int64_t *values, const ranks *r)
{
    const kt_tensor *t = &f->view;
    int64_t n = kt_tensor_numel(t), idx[KT_MAX_DIMS] = {0};
    for (int64_t i = 0; i < n; i++) {
        int64_t g = 0; /* the flat index in the global shape */
        for (int k = 0; k < t->ndim; k++) {
            int64_t at = k == f->shard_dim ? shard_index(f, r, t->shape[k], idx[k]) : idx[k];
            g = g * f->global[k] + at;
        }
        int64_t v = values[g];
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
    if (load_window(d, mul_mod(step, d->window, d->n_tokens)) != 0)
        return 1;
    for (int k = 0; k < d->n_feeds; k++) {
        feed_values(d, &d->feeds[k]);
        fill_feed(&d->feeds[k], d->values, r);
    }
    return 0;
}

int64_t data_windows(const token_data *d)
{
    return (d->n_tokens - 1) / d->window;
}

double data_bytes_per_token(const token_data *d)
{
    if (d->prepared)
        return d->n_tokens > 0 ? (double)d->source_bytes / (double)d->n_tokens : 0.0;
    return d->token_bytes == 1 ? 1.0 : 0.0;
}

/* Over the whole file, in runs: each token that is a target that counts (a flat file's every
 * token), given to add(). */
static int each_counted(token_data *d, void (*add)(void *, int64_t), void *ctx)
{
    enum { RUN = 1 << 16 };
    int64_t *ids, *mask, *docs, prev = -1;
    if (run_buffer(&ids, &mask, &docs, RUN) == NULL)
        return train_fail("out of memory counting the tokens", NULL);
    int failed = 0;
    for (int64_t first = 0; first < d->n_tokens && !failed; first += RUN) {
        const int64_t n = d->n_tokens - first < RUN ? d->n_tokens - first : RUN;
        failed = read_run(d, COL_TOKENS, first, n, ids) ||
                 (d->prepared && (read_run(d, COL_MASK, first, n, mask) ||
                                  read_run(d, COL_DOCS, first, n, docs)));
        for (int64_t i = 0; i < n && !failed; i++) {
            int counted = !d->prepared || (mask[i] && first + i > 0 && docs[i] == prev);
            if (d->prepared)
                prev = docs[i];
            if (counted)
                add(ctx, ids[i]);
        }
    }
    free(ids);
    return failed;
}

typedef struct unigram {
    int64_t *counts, v, total, span;
} unigram;

static void add_count(void *ctx, int64_t id)
{
    unigram *u = ctx;
    if (id >= 0 && id < u->v)
        u->counts[id]++;
    u->total++;
}

static void add_span(void *ctx, int64_t id)
{
    unigram *u = ctx;
    if (id + 1 > u->span)
        u->span = id + 1;
}

int data_unigram_loss(token_data *train, token_data *heldout, double *nats_out)
{
    unigram u = {.v = train->bound};
    if (u.v < 0) { /* the largest id counted (the ids were checked non-negative at open) */
        if (each_counted(train, add_span, &u) != 0 || each_counted(heldout, add_span, &u) != 0)
            return 1;
        u.v = u.span;
    }
    if ((u.counts = calloc((size_t)(u.v > 0 ? u.v : 1), sizeof *u.counts)) == NULL)
        return train_fail("out of memory for the unigram counts", NULL);
    int failed = each_counted(train, add_count, &u);
    double total = (double)u.total + (double)u.v, sum = 0;
    int64_t predicted = 0;
    /* the held-out windows' targets that count, as the targets input gets them */
    for (int64_t w = 0; w < data_windows(heldout) && !failed; w++) {
        failed = load_window(heldout, w * heldout->window);
        for (int64_t i = 1; i <= heldout->window && !failed; i++) {
            if (!counts(heldout, i))
                continue;
            int64_t id = heldout->buf[i];
            double c = id >= 0 && id < u.v ? (double)u.counts[id] : 0.0;
            sum -= log((c + 1.0) / total);
            predicted++;
        }
    }
    free(u.counts);
    if (failed)
        return 1;
    *nats_out = predicted > 0 ? sum / (double)predicted : NAN;
    return 0;
}
