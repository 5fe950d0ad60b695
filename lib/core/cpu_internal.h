/* Fast feature checks for kernel dispatch (after the first call: one load each). */
#ifndef KT_CORE_CPU_INTERNAL_H
#define KT_CORE_CPU_INTERNAL_H

int kt__cpu_has_avx512(void);      /* avx512f + avx512bw, OS-enabled */
int kt__cpu_has_avx512_bf16(void);
int kt__cpu_has_f16c(void);         /* avx2 + f16c, OS-enabled */
int kt__cpu_has_avx2(void);         /* avx2 + fma + f16c, OS-enabled: the AVX2 kernels' set */
int kt__cpu_bf16_on_fma(void);      /* kt_cpu_features.bf16_on_fma */
int kt__cpu_is_intel(void);         /* cpuid vendor GenuineIntel (tuning choices) */
int kt__cpu_f32_on_blas(void);      /* KT_CPU=blas: every f32 GEMM through OpenBLAS */

#endif
