/* e^x for 16 float32 lanes (AVX-512F), for 8 (AVX2 + FMA), for 4 (ARM64 NEON) and for an
   SVE vector's, shared by qkv's native kernels (_paged.c, tiled/_step.h): e^x = 2^y with
   y = x · log2(e) rounded once, y = n + r with n the nearest integer (so r = y - n is exact,
   |r| <= 1/2), 2^r by a degree-6 polynomial, scaled by 2^n. The one rounding of y costs
   2^-24 · |y| relative error (a few units in float32's last place for the |x| <= 10 whose
   e^x still weigh in a softmax, more only where e^x is below 1e-4); the polynomial 1.3
   units. NaN stays NaN. */
#ifndef QKV_EXP_H
#define QKV_EXP_H

#define QKV_LOG2E 1.44269504088896341f

/* p = 2^r for |r| <= 1/2 by the degree-6 polynomial closest to it in relative error (Remez:
   1.9e-9 before float32 rounds the coefficients; 1.3 units in float32's last place as
   Horner's form evaluates it), for any vector width: FMADD(a, b, c) is a · b + c fused,
   SET1(x) x in every lane. */
#define QKV_EXP2_POLY(FMADD, SET1, p, r)                                                           \
    do {                                                                                           \
        p = SET1(1.534581242594868e-4f);                                                           \
        p = FMADD(p, r, SET1(1.3399930903688073e-3f));                                             \
        p = FMADD(p, r, SET1(9.618489071726799e-3f));                                              \
        p = FMADD(p, r, SET1(5.550328642129898e-2f));                                              \
        p = FMADD(p, r, SET1(0.24022646248340607f));                                               \
        p = FMADD(p, r, SET1(0.6931471824645996f));                                                \
        p = FMADD(p, r, SET1(1.0f));                                                               \
    } while (0)

/* y + QKV_EXP_SHIFT is y rounded to the nearest integer n plus the shift (the sum's unit in
   the last place is 1, for |y| < 2^22): its bits' low part then holds n + 127, 2^n's
   exponent field, which a shift left by 23 moves into place; minus the shift it is n. For
   the widths with no scalef. */
#define QKV_EXP_SHIFT (12582912.0f + 127.0f) /* 1.5 · 2^23, plus the exponent's bias */

#if defined(__x86_64__)
#include <immintrin.h>

/* Inputs below -104 give exp(-104): 0 in float32 or its smallest subnormal. */
static inline __attribute__((always_inline, target("avx512f"))) __m512 qkv_exp16(__m512 x) {
    const __m512 y = _mm512_mul_ps(_mm512_max_ps(_mm512_set1_ps(-104.0f), x),
                                   _mm512_set1_ps(QKV_LOG2E)),
                 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                 r = _mm512_sub_ps(y, n);
    __m512 p;
    QKV_EXP2_POLY(_mm512_fmadd_ps, _mm512_set1_ps, p, r);
    return _mm512_scalef_ps(p, n);
}

/* AVX2 has no scalef, so 2^n is built in the exponent bits, and inputs below -88 give 0
   (2^-127 built as 0). */
static inline __attribute__((always_inline, target("avx2,fma"))) __m256 qkv_exp8(__m256 x) {
    const __m256 shift = _mm256_set1_ps(QKV_EXP_SHIFT),
                 y = _mm256_mul_ps(_mm256_max_ps(_mm256_set1_ps(-88.0f), x),
                                   _mm256_set1_ps(QKV_LOG2E)),
                 t = _mm256_add_ps(y, shift), r = _mm256_sub_ps(y, _mm256_sub_ps(t, shift));
    __m256 p;
    QKV_EXP2_POLY(_mm256_fmadd_ps, _mm256_set1_ps, p, r);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23)));
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
    const float32x4_t shift = vdupq_n_f32(QKV_EXP_SHIFT),
                      y = vmulq_n_f32(vmaxq_f32(vdupq_n_f32(-88.0f), x), QKV_LOG2E),
                      t = vaddq_f32(y, shift), r = vsubq_f32(y, vsubq_f32(t, shift));
    float32x4_t p;
    QKV_EXP2_POLY(qkv_fmadd4, vdupq_n_f32, p, r);
    return vmulq_f32(p, vreinterpretq_f32_s32(vshlq_n_s32(vreinterpretq_s32_f32(t), 23)));
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
    const svfloat32_t y = svmul_n_f32_x(all, svmax_n_f32_x(all, x, -88.0f), QKV_LOG2E),
                      t = svadd_n_f32_x(all, y, QKV_EXP_SHIFT),
                      r = svsub_f32_x(all, y, svsub_n_f32_x(all, t, QKV_EXP_SHIFT));
    svfloat32_t p;
    QKV_EXP2_POLY(qkv_fmadd_sve, svdup_n_f32, p, r);
    const svint32_t two_n = svlsl_n_s32_x(all, svreinterpret_s32_f32(t), 23);
    return svmul_f32_x(all, p, svreinterpret_f32_s32(two_n));
}
#endif
#endif
#endif
