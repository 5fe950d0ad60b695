/* A tiny application built against an installed libkt: checks the version, runs one op. */
#include <kt/kt.h>
#include <stdio.h>

int main(void)
{
    if (kt_version() != KT_VERSION_HEX) {
        fprintf(stderr, "header %s does not match library %s\n", KT_VERSION_STRING,
                kt_version_string());
        return 1;
    }
    float a[2] = {1.5f, -2.0f}, b[2] = {0.25f, 4.0f}, c[2] = {0};
    kt_tensor in[2], out;
    const int64_t shape[1] = {2};
    if (kt_tensor_init(&in[0], a, KT_F32, 1, shape) != KT_OK ||
        kt_tensor_init(&in[1], b, KT_F32, 1, shape) != KT_OK ||
        kt_tensor_init(&out, c, KT_F32, 1, shape) != KT_OK ||
        kt_op_forward(KT_OP_MUL, NULL, in, 2, &out, 1, NULL) != KT_OK) {
        fprintf(stderr, "kt: %s\n", kt_last_error());
        return 1;
    }
    if (c[0] != 0.375f || c[1] != -8.0f) {
        fprintf(stderr, "wrong result %g %g\n", c[0], c[1]);
        return 1;
    }
    printf("consumer: libkt %s [%s] ok\n", kt_version_string(), kt_build_features());
    return 0;
}
