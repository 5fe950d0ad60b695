/* Reading config.json's members: typed look-ups whose errors name the file and the key. */
#ifndef KT_HF_CONFIG_JSON_H
#define KT_HF_CONFIG_JSON_H

#include <stdint.h>

#include "kt/status.h"
#include "lib/io/json.h"

typedef struct kt__hf_json {
    const kt__json_value *obj; /* the object read */
    const char *path;          /* config.json's path, for messages */
    const char *where;         /* "" or "rope_parameters." for nested keys */
} kt__hf_json;

/* The member named key, or NULL when absent. A member whose value is null counts as absent
 * (transformers writes None as null for "use the default"). */
const kt__json_value *kt__hf_member(const kt__hf_json *j, const char *key);

/* Each reads key into *out: absent (or null) leaves *out at the default the caller set when
 * required is 0, and is an error naming the key when it is 1. A value of the wrong type or out
 * of [lo, hi] is an error naming the key and the value. */
kt_status kt__hf_int(const kt__hf_json *j, const char *key, int required, int64_t lo,
                     int64_t hi, int64_t *out);
kt_status kt__hf_num(const kt__hf_json *j, const char *key, int required, double lo,
                     double hi, double *out);
kt_status kt__hf_bool(const kt__hf_json *j, const char *key, int *out);
/* A string member (NULL when absent or null); the text lives as long as the document. */
kt_status kt__hf_str(const kt__hf_json *j, const char *key, const char **out);

/* KT_EUNSUPPORTED "PATH: KEY = VALUE: why" with the value as written in the file. */
kt_status kt__hf_unsupported(const kt__hf_json *j, const char *key, const char *why);

#endif
