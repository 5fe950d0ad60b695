/* CPU feature detection: cpuid for what the CPU has, xgetbv for what the OS saves, and the
 * Linux permission request without which AMX instructions fault. */
#define _GNU_SOURCE /* syscall() for the AMX permission request */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/cpu_internal.h"
#include "lib/core/env.h"
#include "kt/runtime.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KT__ARCH_REQ_XCOMP_PERM 0x1023
#define KT__XFEATURE_XTILEDATA 18
#endif

static kt_cpu_features features;
static int f32_on_blas;
static int vendor_intel;
static char description[160];
static pthread_once_t detect_once = PTHREAD_ONCE_INIT;

#if defined(__x86_64__)
static unsigned long long read_xcr0(void)
{
    unsigned eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}

static int request_amx_permission(void)
{
    /* Linux >= 5.16 requires each process to ask for the AMX tile data state. */
    long rc = syscall(SYS_arch_prctl, KT__ARCH_REQ_XCOMP_PERM, KT__XFEATURE_XTILEDATA);
    return rc == 0;
}
#endif

static void detect(void)
{
    memset(&features, 0, sizeof features);
    /* KT_CPU=portable hides every vector extension, so the portable kernels can be tested
     * (and compared with the vector ones) on a machine that has them; KT_CPU=noamx hides AMX
     * alone, so the AVX-512 kernels can be measured against the tiles on one machine;
     * KT_CPU=dpbf16 and KT_CPU=widen choose the bf16 GEMMs' AVX-512 path against the vendor
     * rule below (to test and time both on one machine); KT_CPU=blas sends every f32 GEMM
     * to OpenBLAS: the MoE layer's and kt__sgemm's (to compare them with the own kernels);
     * KT_CPU=avx2 hides AVX-512 and AMX, so that an AVX-512 machine runs the AVX2 kernels. */
    int forced; /* a bad value counts as unset here; kt_check_environment reports it */
    if (kt__env_choice("KT_CPU", kt__cpu_choices, KT__CPU_CHOICES, &forced) != KT_OK)
        forced = -1;
    int portable = forced == KT__CPU_PORTABLE, noamx = forced == KT__CPU_NOAMX;
    int dpbf16 = forced == KT__CPU_DPBF16, widen = forced == KT__CPU_WIDEN;
    f32_on_blas = forced == KT__CPU_BLAS;
#if defined(__x86_64__)
    if (!portable) {
    unsigned a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        int osxsave = (c >> 27) & 1;
        int avx = (c >> 28) & 1;
        int fma = (c >> 12) & 1;
        int f16c = (c >> 29) & 1;
        unsigned long long xcr0 = osxsave ? read_xcr0() : 0;
        int ymm_ok = (xcr0 & 0x6) == 0x6;
        int zmm_ok = ymm_ok && (xcr0 & 0xe0) == 0xe0 && forced != KT__CPU_AVX2;
        int tile_ok = (xcr0 & 0x60000) == 0x60000 && forced != KT__CPU_AVX2;
        unsigned a7 = 0, b7 = 0, c7 = 0, d7 = 0, a71 = 0, b71 = 0, c71 = 0, d71 = 0;
        __cpuid_count(7, 0, a7, b7, c7, d7);
        __cpuid_count(7, 1, a71, b71, c71, d71);
        (void)c7;
        (void)b71;
        (void)c71;
        (void)d71;
        int avx2 = (b7 >> 5) & 1;
        features.avx2 = ymm_ok && avx && avx2 && fma;
        features.f16c = ymm_ok && avx && f16c;
        features.avx512f = zmm_ok && ((b7 >> 16) & 1);
        features.avx512bw = features.avx512f && ((b7 >> 30) & 1);
        features.avx512_bf16 = features.avx512f && ((a71 >> 5) & 1);
        features.amx_tile = (d7 >> 24) & 1;
        features.amx_bf16 = (d7 >> 22) & 1;
        if (noamx)
            features.amx_tile = features.amx_bf16 = 0;
        if (features.amx_tile && tile_ok)
            features.amx_usable = request_amx_permission();
        /* Intel cores multiply bf16 faster on the FMA units, widened, than with vdpbf16ps;
         * AMD Zen 4 and 5 keep vdpbf16ps (why and the figures: lib/kernels/fma_gemm.h). */
        unsigned v0, vb, vc, vd;
        __cpuid(0, v0, vb, vc, vd);
        (void)v0;
        const int intel = vb == 0x756e6547u && vd == 0x49656e69u && vc == 0x6c65746eu;
        vendor_intel = intel;
        const int avx512 = features.avx512f && features.avx512bw;
        features.bf16_on_fma =
            avx512 && (widen || (!dpbf16 && (intel || !features.avx512_bf16)));
    }
    }
#else
    (void)portable;
    (void)noamx;
    (void)dpbf16;
    (void)widen;
#endif
    const struct {
        int on;
        const char *name;
    } names[] = {{features.avx2, "avx2"},         {features.f16c, "f16c"},
                 {features.avx512f, "avx512f"},   {features.avx512bw, "avx512bw"},
                 {features.avx512_bf16, "avx512_bf16"}, {features.amx_tile, "amx_tile"},
                 {features.amx_bf16, "amx_bf16"}, {features.amx_usable, "amx_usable"},
                 {features.bf16_on_fma, "bf16_on_fma"}};
    size_t n = 0;
    description[0] = '\0';
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (names[i].on && n < sizeof description)
            n += (size_t)snprintf(description + n, sizeof description - n, "%s%s",
                                  n ? " " : "", names[i].name);
    if (n == 0)
        snprintf(description, sizeof description, "portable");
}

const kt_cpu_features *kt_cpu_get_features(void)
{
    pthread_once(&detect_once, detect);
    return &features;
}

const char *kt_cpu_describe(void)
{
    pthread_once(&detect_once, detect);
    return description;
}

int kt__cpu_has_avx512(void)
{
    const kt_cpu_features *f = kt_cpu_get_features();
    return f->avx512f && f->avx512bw;
}

int kt__cpu_has_avx512_bf16(void) { return kt_cpu_get_features()->avx512_bf16; }

int kt__cpu_has_f16c(void)
{
    const kt_cpu_features *f = kt_cpu_get_features();
    return f->avx2 && f->f16c;
}

int kt__cpu_has_avx2(void)
{
    const kt_cpu_features *f = kt_cpu_get_features();
    return f->avx2 && f->f16c;
}

int kt__cpu_bf16_on_fma(void) { return kt_cpu_get_features()->bf16_on_fma; }

int kt__cpu_is_intel(void)
{
    pthread_once(&detect_once, detect);
    return vendor_intel;
}

int kt__cpu_f32_on_blas(void)
{
    pthread_once(&detect_once, detect);
    return f32_on_blas;
}
