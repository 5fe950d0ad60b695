/* kt-train's reader of its own run.json (flat_json.c): nested objects of strings and
 * integers, flattened to "outer.inner" paths. */
#ifndef KT_TRAIN_FLAT_JSON_H
#define KT_TRAIN_FLAT_JSON_H

#include <stddef.h>

#define FLAT_JSON_PATH 96
#define FLAT_JSON_MAX 96

typedef struct flat_json_field {
    char path[FLAT_JSON_PATH];
    char value[512];
    int is_string; /* 0: an integer, as written */
} flat_json_field;

typedef struct flat_json {
    flat_json_field fields[FLAT_JSON_MAX];
    int n;
} flat_json;

/* 0, or -1 with what is wrong and where in err. */
int flat_json_parse(const char *text, size_t len, flat_json *out, char *err, size_t err_size);
/* The field at path ("settings.lr"), or NULL. */
const flat_json_field *flat_json_get(const flat_json *j, const char *path);

#endif
