/* Choosing the next token from the logits: greedy (argmax, the first of equal maxima), or
 * sampled: softmax of logits / temperature, then the top-k most probable, then the smallest
 * prefix of those (most probable first) whose probability reaches top-p, then one draw from
 * what is left, renormalised. The draws come from xoshiro256** seeded through splitmix64, so a
 * seed gives the same tokens on every machine. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tools/kt-generate/generate.h"

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static uint64_t next_u64(uint64_t s[4])
{
    const uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

/* uniform in [0, 1) */
static double next_unit(uint64_t s[4])
{
    return (double)(next_u64(s) >> 11) * 0x1.0p-53;
}

int gen_sampler_init(gen_sampler *s, int greedy, double temperature, int64_t top_k,
                     double top_p, uint64_t seed, int64_t vocab)
{
    memset(s, 0, sizeof *s);
    s->greedy = greedy || temperature == 0.0;
    s->temperature = temperature;
    s->top_k = top_k;
    s->top_p = top_p;
    s->vocab = vocab;
    for (int i = 0; i < 4; i++)
        s->state[i] = splitmix64(&seed);
    s->order = malloc((size_t)vocab * sizeof *s->order);
    s->prob = malloc((size_t)vocab * sizeof *s->prob);
    if (s->order == NULL || s->prob == NULL) {
        gen_sampler_free(s);
        return gen_error("out of memory (a vocabulary of %lld)", (long long)vocab);
    }
    return 0;
}

static int64_t argmax(const float *x, int64_t n)
{
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

/* qsort's context: most probable first, equal ones by id (so the order is one order) */
static const double *sort_prob;

static int by_prob(const void *a, const void *b)
{
    const int64_t i = *(const int64_t *)a, j = *(const int64_t *)b;
    if (sort_prob[i] != sort_prob[j])
        return sort_prob[i] > sort_prob[j] ? -1 : 1;
    return (i > j) - (i < j);
}

int64_t gen_sampler_pick(gen_sampler *s, const float *logits)
{
    const int64_t n = s->vocab;
    if (s->greedy)
        return argmax(logits, n);
    const double top = logits[argmax(logits, n)];
    for (int64_t i = 0; i < n; i++) {
        s->prob[i] = exp(((double)logits[i] - top) / s->temperature);
        s->order[i] = i;
    }
    int64_t kept = n;
    if (s->top_k > 0 || s->top_p < 1.0) {
        sort_prob = s->prob;
        qsort(s->order, (size_t)n, sizeof *s->order, by_prob);
        if (s->top_k > 0 && s->top_k < kept)
            kept = s->top_k;
        if (s->top_p < 1.0) {
            double total = 0.0, sum = 0.0;
            for (int64_t r = 0; r < kept; r++)
                total += s->prob[s->order[r]];
            int64_t r = 0;
            while (r < kept && (sum += s->prob[s->order[r]]) < s->top_p * total)
                r++;
            kept = r < kept ? r + 1 : kept;
        }
    }
    double total = 0.0;
    for (int64_t r = 0; r < kept; r++)
        total += s->prob[s->order[r]];
    const double u = next_unit(s->state) * total;
    double sum = 0.0;
    for (int64_t r = 0; r < kept; r++) {
        sum += s->prob[s->order[r]];
        if (u < sum)
            return s->order[r];
    }
    return s->order[kept - 1]; /* u within rounding of the total */
}

void gen_sampler_free(gen_sampler *s)
{
    free(s->order);
    free(s->prob);
    s->order = NULL;
    s->prob = NULL;
}
