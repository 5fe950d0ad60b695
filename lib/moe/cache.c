/* The forward cache for checkpoint recompute: EMPTY -> READY (a forward stored its output)
 * -> EMPTY (backward consumed it). Any failure while it is on makes it POISONED, which fails
 * every forward and backward with the first failure's message until kt_moe_cache_clear: a
 * recompute must never silently run on a half-failed step. */
#include <stdio.h>

#include "lib/core/error.h"
#include "lib/moe/moe_internal.h"

kt_status kt_moe_cache_enable(kt_moe *moe, int on)
{
    if (moe == NULL)
        return kt__error(KT_EINVAL, "kt_moe_cache_enable: moe is NULL");
    if (moe->async.busy)
        return kt__error(KT_ESTATE, "moe '%s': cache_enable while a forward is in flight",
                         moe->name);
    if (on) { /* the cache stores the staged output */
        kt_status st = kt__moe_alloc_staged_y(moe);
        if (st != KT_OK)
            return kt__error_context(st, "moe '%s': the forward cache's output", moe->name);
    }
    moe->cache.on = on != 0;
    if (!moe->cache.on)
        atomic_store(&moe->cache.state, KT_MOE_CACHE_EMPTY);
    return KT_OK;
}

kt_moe_cache_state kt_moe_cache_get_state(const kt_moe *moe)
{
    if (moe == NULL)
        return KT_MOE_CACHE_EMPTY;
    return (kt_moe_cache_state)atomic_load(&((kt_moe *)moe)->cache.state);
}

void kt_moe_cache_clear(kt_moe *moe)
{
    if (moe == NULL)
        return;
    atomic_store(&moe->cache.state, KT_MOE_CACHE_EMPTY);
    moe->cache.poison_msg[0] = '\0';
}

/* Called right after a failure was recorded on this thread; keeps the first message. */
void kt__moe_poison(kt_moe *m)
{
    if (!m->cache.on || atomic_load(&m->cache.state) == KT_MOE_CACHE_POISONED)
        return;
    snprintf(m->cache.poison_msg, sizeof m->cache.poison_msg, "%s", kt_last_error());
    atomic_store(&m->cache.state, KT_MOE_CACHE_POISONED);
}

kt_status kt__moe_check_poison(const kt_moe *m, const char *what)
{
    if (atomic_load(&((kt_moe *)m)->cache.state) != KT_MOE_CACHE_POISONED)
        return KT_OK;
    return kt__error(KT_ESTATE,
                     "moe '%s': %s refused: the forward cache was poisoned by an earlier "
                     "failure (kt_moe_cache_clear resets it): %s",
                     m->name, what, m->cache.poison_msg);
}
