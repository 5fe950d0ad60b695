/* The string pool (see strings.h). */
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "graph/strings.h"

kt_status kt__strings_add(kt__strings *pool, const char *s, int32_t *offset_out)
{
    size_t n = strlen(s) + 1;
    if (pool->len + n > INT32_MAX)
        return kt__error(KT_ENOMEM, "string pool full");
    if (pool->len + n > pool->cap) {
        size_t cap = pool->cap ? pool->cap : 256;
        while (cap < pool->len + n)
            cap *= 2;
        char *p = realloc(pool->data, cap);
        if (p == NULL)
            return kt__error(KT_ENOMEM, "out of memory for names");
        pool->data = p;
        pool->cap = cap;
    }
    memcpy(pool->data + pool->len, s, n);
    *offset_out = (int32_t)pool->len;
    pool->len += n;
    return KT_OK;
}

const char *kt__strings_get(const kt__strings *pool, int32_t offset)
{
    return offset < 0 || pool->data == NULL ? "" : pool->data + offset;
}

void kt__strings_free(kt__strings *pool)
{
    free(pool->data);
    memset(pool, 0, sizeof *pool);
}
