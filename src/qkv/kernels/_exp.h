/* e^x for 16 float32 lanes (AVX-512F), for 8 (AVX2 + FMA), for 4 (ARM64 NEON) and for an
   SVE vector's, shared by qkv's native kernels (_paged.c, tiled/_step.h): x = n·ln2 + r
   with ln2 in two parts (Cody-Waite, so r stays exact for large |x|), e^r by its degree-7
   Taylor polynomial (|r| <= ln2/2: error under float32's rounding), scaled by 2^n. NaN
   stays NaN. */
#ifndef QKV_EXP_H
#define QKV_EXP_H

/* p = e^r by its degree-7 Taylor polynomial in Horner's form, for any vector width:
   FMADD(a, b, c) is a · b + c fused, SET1(x) x in every lane. */
#define QKV_EXP_TAYLOR(FMADD, SET1, p, r)                                                          \
    do {                                                                                           \
        p = SET1(1.0f / 5040);                                                                     \
        p = FMADD(p, r, SET1(1.0f / 720));                                                         \
        p = FMADD(p, r, SET1(1.0f / 120));                                                         \
        p = FMADD(p, r, SET1(1.0f / 24));                                                          \
        p = FMADD(p, r, SET1(1.0f / 6));                                                           \
        p = FMADD(p, r, SET1(0.5f));                                                               \
        p = FMADD(p, r, SET1(1.0f));                                                               \
        p = FMADD(p, r, SET1(1.0f));                                                               \
    } while (0)

#if defined(__x86_64__)
#include <immintrin.h>

/* p = e^r for x = n·ln2 + r, in the intrinsics PRE_* of one width (_mm512 or _mm256). */
#define QKV_EXP_POLY(PRE, x, n, p)                                                                 \
    do {                                                                                           \
        __typeof__(x) r = PRE##_fnmadd_ps(n, PRE##_set1_ps(0.693145751953125f), x);                \
        r = PRE##_fnmadd_ps(n, PRE##_set1_ps(1.428606765330187045e-06f), r);                       \
        QKV_EXP_TAYLOR(PRE##_fmadd_ps, PRE##_set1_ps, p, r);                                       \
    } while (0)

/* Inputs below -104 give exp(-104): 0 in float32 or its smallest subnormal. */
static inline __attribute__((always_inline, target("avx512f"))) __m512 qkv_exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 p;
    QKV_EXP_POLY(_mm512, x, n, p);
    return _mm512_scalef_ps(p, n);
}

/* For the x >= -87 the tiled step keeps (it zeroes the rest): AVX2 has no scalef, so 2^n is
   built in the exponent bits, and inputs below -88 give 0 (2^-127 built as 0). */
static inline __attribute__((always_inline, target("avx2,fma"))) __m256 qkv_exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-88.0f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 p;
    QKV_EXP_POLY(_mm256, x, n, p);
    __m256i two_n =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#elif defined(__aarch64__)
#include <arm_neon.h>

/* a · b + c, fused, in NEON's operand order. */
static inline __attribute__((always_inline)) float32x4_t qkv_fmadd4(float32x4_t a, float32x4_t b,
                                                                    float32x4_t c) {
    return vfmaq_f32(c, a, b);
}

/* As qkv_exp8: 2^n built in the exponent bits, inputs below -88 give 0. */
static inline __attribute__((always_inline)) float32x4_t qkv_exp4(float32x4_t x) {
    x = vmaxq_f32(vdupq_n_f32(-88.0f), x);
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693145751953125f));
    r = vfmsq_f32(r, n, vdupq_n_f32(1.428606765330187045e-06f));
    float32x4_t p;
    QKV_EXP_TAYLOR(qkv_fmadd4, vdupq_n_f32, p, r);
    int32x4_t two_n = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(two_n));
}

#ifdef __ARM_FEATURE_SVE /* (a translation unit compiled for SVE: tiled/_simd.h's) */
#include <arm_sve.h>

/* a · b + c, fused, over a whole SVE vector. */
static inline __attribute__((always_inline)) svfloat32_t qkv_fmadd_sve(svfloat32_t a, svfloat32_t b,
                                                                       svfloat32_t c) {
    return svmad_f32_x(svptrue_b32(), a, b, c);
}

/* As qkv_exp4, over one SVE vector of any length. */
static inline __attribute__((always_inline)) svfloat32_t qkv_exp_sve(svfloat32_t x) {
    const svbool_t all = svptrue_b32();
    x = svmax_n_f32_x(all, x, -88.0f);
    const svfloat32_t n = svrintn_f32_x(all, svmul_n_f32_x(all, x, 1.44269504088896341f));
    svfloat32_t r = svmls_n_f32_x(all, x, n, 0.693145751953125f); /* x - n · ln2's parts */
    r = svmls_n_f32_x(all, r, n, 1.428606765330187045e-06f);
    svfloat32_t p;
    QKV_EXP_TAYLOR(qkv_fmadd_sve, svdup_n_f32, p, r);
    const svint32_t two_n =
        svlsl_n_s32_x(all, svadd_n_s32_x(all, svcvt_s32_f32_x(all, n), 127), 23);
    return svmul_f32_x(all, p, svreinterpret_f32_s32(two_n));
}
#endif
#endif
#endif
