/* libFuzzer target: a sharded checkpoint's index (model.safetensors.index.json).
 *
 * The input is the index's text; the shards are fixed files written once into a temporary
 * directory (removed at exit): a.safetensors (x f32[2], y bf16[3]), b.safetensors (z f64[2]),
 * sub/c.safetensors (w i64[1]) and bad.safetensors (truncated). When an index is accepted,
 * every tensor it maps must be found, in the shard it names, and read (converted to f32 where
 * it is a float); every shard's tensor must be listed. A broken invariant aborts. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kt/io.h"
#include "lib/io/st_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char dir[64];

static void remove_shards(void)
{
    static const char *const names[] = {"a.safetensors", "b.safetensors", "sub/c.safetensors",
                                        "bad.safetensors", "sub", NULL};
    char path[128];
    for (int i = 0; names[i] != NULL; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        remove(path);
    }
    rmdir(dir);
}

static void write_shard(const char *name, const char *header, size_t data_len, size_t cut)
{
    char path[128];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    size_t h = strlen(header), size = 8 + h + data_len;
    unsigned char *img = calloc(1, size);
    if (img == NULL)
        abort();
    for (int i = 0; i < 8; i++)
        img[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(img + 8, header, h);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(img, 1, size - cut, f) != size - cut || fclose(f) != 0)
        abort();
    free(img);
}

static void make_shards(void)
{
    strcpy(dir, "/tmp/kt_fuzz_index.XXXXXX");
    if (mkdtemp(dir) == NULL)
        abort();
    atexit(remove_shards);
    char sub[96];
    snprintf(sub, sizeof sub, "%s/sub", dir);
    if (mkdir(sub, 0700) != 0)
        abort();
    write_shard("a.safetensors",
                "{\"__metadata__\":{\"format\":\"pt\"},"
                "\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                "\"y\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[8,14]}}",
                14, 0);
    write_shard("b.safetensors", "{\"z\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[0,16]}}",
                16, 0);
    write_shard("sub/c.safetensors",
                "{\"w\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, 0);
    write_shard("bad.safetensors", "{\"v\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}",
                16, 5);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (dir[0] == '\0')
        make_shards();
    kt_st_file *f = NULL;
    if (kt__st_open_index_text((const char *)data, size, "fuzz.index.json", dir, &f) != KT_OK) {
        if (f != NULL)
            abort(); /* a failed open leaves NULL */
        return 0;
    }
    if (!kt_st_is_sharded(f))
        abort();
    for (size_t i = 0; i < kt_st_count(f); i++) {
        kt_st_info info;
        size_t at;
        if (kt_st_entry_info(f, i, &info) != KT_OK || kt_st_lookup(f, info.name, &at) != KT_OK ||
            at != i || info.shard >= kt_st_shard_count(f) ||
            strcmp(kt_st_entry_file(f, i), kt_st_shard_name(f, info.shard)) != 0)
            abort();
        float buf[4];
        kt_tensor dst;
        if (info.ndim != 1 || info.shape[0] > 4 ||
            kt_tensor_init(&dst, buf, strcmp(info.file_dtype, "I64") == 0 ? KT_I64 : KT_F32, 1,
                           info.shape) != KT_OK)
            abort(); /* only the fixed shards' tensors can be there */
        int64_t wide[1];
        if (dst.dtype == KT_I64)
            dst.data = wide;
        if (kt_st_read_convert(f, info.name, &dst) != KT_OK)
            abort();
    }
    (void)kt_st_metadata(f, "total_size");
    (void)kt_st_metadata(f, "format");
    kt_st_close(f);
    return 0;
}
