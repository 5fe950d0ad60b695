/* libFuzzer target: the .ktp loader, and running whatever it accepts.
 *
 * Each input is loaded twice: as it is (the header checks and the checksum), and as a copy
 * whose body size and CRC-32 are repaired, so that mutations reach the table parsing and the
 * program validation instead of stopping at the checksum. A program that loads is described,
 * and, when its memory is small, run in a one-thread session: forward, and backward when it
 * has a backward schedule. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kt/program.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Programs whose session would need more than this are loaded but not run: the fuzzer's
 * malloc limit would otherwise report the (legitimate) large allocation as a crash. */
#define RUN_LIMIT_BYTES (64u << 20)

static uint32_t crc32_ieee(const unsigned char *p, size_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
    }
    return ~c;
}

static void exercise(const uint8_t *data, size_t size)
{
    kt_program *p = NULL;
    if (kt_program_load_memory(data, size, &p) != KT_OK)
        return;
    kt_program_stats st;
    kt_program_get_stats(p, &st);
    char text[512];
    kt_program_describe(p, text, sizeof text);
    for (int role = KT_ROLE_INPUT; role <= KT_ROLE_GRAD; role++)
        for (int i = 0; i < kt_program_count(p, (kt_tensor_role)role); i++)
            kt_program_tensor_info(p, (kt_tensor_role)role, i, NULL, NULL);
    if (st.arena_bytes <= RUN_LIMIT_BYTES && st.param_bytes <= RUN_LIMIT_BYTES &&
        st.grad_bytes <= RUN_LIMIT_BYTES) {
        kt_session_options so;
        memset(&so, 0, sizeof so);
        so.threads = 1;
        kt_session *s = NULL;
        if (kt_session_create(p, &so, &s) == KT_OK) {
            if (kt_session_forward(s) == KT_OK && st.n_backward_steps > 0)
                (void)kt_session_backward(s);
            kt_session_destroy(s);
        }
    }
    kt_program_destroy(p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    exercise(data, size);
    /* "KTPROGRM" | u32 version | u32 flags | u64 body size | body | u32 CRC-32 */
    if (size < 28)
        return 0;
    unsigned char *fixed = malloc(size);
    if (fixed == NULL)
        return 0;
    memcpy(fixed, data, size);
    uint64_t body = size - 28;
    for (int i = 0; i < 8; i++)
        fixed[16 + i] = (unsigned char)(body >> (8 * i));
    uint32_t crc = crc32_ieee(fixed, size - 4);
    for (int i = 0; i < 4; i++)
        fixed[size - 4 + (size_t)i] = (unsigned char)(crc >> (8 * i));
    if (memcmp(fixed, data, size) != 0)
        exercise(fixed, size);
    free(fixed);
    return 0;
}
