/* The statements that annotate the graph for later passes: the checkpoint policy and input
 * sharding (the checkpoint blocks are in parse.c, with the other blocks). */
#include <string.h>

#include "graph/ktg/ktg_internal.h"

void kt__ktg_stmt_policy(kt__ktg_parser *p)
{
    static const char *const names[] = {"none", "segments", "every", "sqrtn", "budget"};
    static const kt_checkpoint_policy_kind kinds[] = {
        KT_CHECKPOINT_NONE, KT_CHECKPOINT_SEGMENTS, KT_CHECKPOINT_EVERY_K, KT_CHECKPOINT_SQRTN,
        KT_CHECKPOINT_BUDGET};
    const char *expected = "none, segments, every(k), sqrtn or budget(bytes)";
    kt__ktg_span kw = p->tok.at;
    kt__ktg_advance(p);
    if (!kt__ktg_is_word(p, &p->tok, "checkpoint")) {
        kt__ktg_expected(p, "'checkpoint' (the only policy)");
        return;
    }
    kt__ktg_advance(p);
    if (!kt__ktg_expect(p, KT__KTG_EQ, "'=' and a policy"))
        return;
    if (p->tok.kind != KT__KTG_IDENT) {
        kt__ktg_expected(p, expected);
        return;
    }
    kt__ktg_token t = p->tok;
    char word[64];
    kt__ktg_text(p, &t, word, sizeof word);
    int which = -1;
    for (int i = 0; i < 5; i++)
        if (t.at.len == strlen(names[i]) && strcmp(word, names[i]) == 0)
            which = i;
    if (which < 0) {
        const char *near = kt__ktg_suggest(word, names, 5);
        if (near != NULL)
            kt__ktg_error(p, t.at, "unknown checkpoint policy '%s' (did you mean '%s'?), "
                          "expected %s", word, near, expected);
        else
            kt__ktg_error(p, t.at, "unknown checkpoint policy '%s', expected %s", word,
                          expected);
        return;
    }
    kt__ktg_advance(p);
    kt_checkpoint_policy policy = {.kind = kinds[which]};
    if (policy.kind == KT_CHECKPOINT_EVERY_K || policy.kind == KT_CHECKPOINT_BUDGET) {
        int64_t v;
        if (!kt__ktg_expect(p, KT__KTG_LPAREN, policy.kind == KT_CHECKPOINT_EVERY_K
                                                   ? "'(' and the number of layers"
                                                   : "'(' and the budget in bytes") ||
            !kt__ktg_expr(p, &v) || !kt__ktg_expect(p, KT__KTG_RPAREN, "')'"))
            return;
        if (v < 1) {
            kt__ktg_error(p, kt__ktg_span_to_here(p, t.at), "%s(%lld), expected a positive "
                          "value", word, (long long)v);
            return;
        }
        if (policy.kind == KT_CHECKPOINT_EVERY_K)
            policy.k = v;
        else
            policy.budget_bytes = (uint64_t)v;
    }
    if (!kt__ktg_end_of_statement(p))
        return;
    if (kt_graph_set_checkpoint_policy(p->g, &policy) != KT_OK)
        kt__ktg_graph_error(p, kw);
}

void kt__ktg_stmt_shard(kt__ktg_parser *p)
{
    kt__ktg_span kw = p->tok.at, at;
    kt__ktg_advance(p);
    kt_value v;
    char name[KT__KTG_NAME_MAX + 1];
    if (!kt__ktg_value_ref(p, &v, name, &at))
        return;
    const kt__ktg_sym *s = kt__ktg_sym_find(&p->syms, name);
    if (!p->poisoned && (s == NULL || !s->is_input)) {
        kt__ktg_error(p, at, "'%s' is not an input, expected the name of an input", name);
        return;
    }
    if (!kt__ktg_is_word(p, &p->tok, "dim")) {
        kt__ktg_expected(p, "'dim' and the dimension to split");
        return;
    }
    kt__ktg_advance(p);
    kt__ktg_span start = p->tok.at;
    int64_t dim;
    if (!kt__ktg_expr(p, &dim) || !kt__ktg_end_of_statement(p))
        return;
    if (dim < 0 || dim > 1000) {
        kt__ktg_error(p, kt__ktg_span_to_here(p, start), "dim %lld, expected a dimension of "
                      "the input", (long long)dim);
        return;
    }
    if (!p->poisoned && kt_graph_shard_input(p->g, v, (int)dim) != KT_OK)
        kt__ktg_graph_error(p, kw);
}
