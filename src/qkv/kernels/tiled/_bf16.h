/* The bfloat16 parts of the AVX-512 step (_step512.c includes them before _step.h): Q, K
   and V stay bfloat16 and both matmuls run as bfloat16 dot products accumulated in float32
   (VDPBF16PS); P and dS enter their matmul as bfloat16 hi + lo. AVX512-BF16 only: no AVX2
   counterpart (bfloat16 runs torch's kernel there). */
#ifndef QKV_BF16_H
#define QKV_BF16_H
#define QKV_BF16 1
#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

/* 32 float32 values as bfloat16 hi (rounded) at hi, and, if lo is given, what hi leaves of
   them rounded again at lo: hi + lo carry about 16 bits. Returns hi's values, lane-wise
   summed over the two halves, as float32. */
TARGET_BF16 static inline __m512 split(__m512 p0, __m512 p1, bf16 *hi, bf16 *lo) {
    __m512i hw = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
    __m512 h0 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hw)), 16));
    __m512 h1 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hw, 1)), 16));
    _mm512_storeu_si512(hi, hw);
    if (lo)
        _mm512_storeu_si512(
            lo, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(p1, h1), _mm512_sub_ps(p0, h0)));
    return _mm512_add_ps(h0, h1);
}

/* S[i][jb..jb+32) = (q_i · k_n) · scale for MR rows (pad32(D) apart; D even) and the 32
   keys of one packed block kb (bfloat16 pairs). (The sums stay in local registers until
   the end: __m512 may alias anything, so sums kept in *S would be stored and reloaded at
   every step.) */
TARGET_BF16 static void dots_bf16(int64_t D, const bf16 *qt, const bf16 *kb, int64_t jb,
                                  __m512 scale, float S[MR][KT]) {
    int64_t qs = pad32(D);
    __m512 acc[MR][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t d2 = 0; d2 < D / 2; d2++) {
        const bf16 *at = kb + d2 * 64;
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(at), k1 = (__m512bh)_mm512_loadu_si512(at + 32);
        for (int i = 0; i < MR; i++) {
            int32_t pair;
            memcpy(&pair, qt + i * qs + 2 * d2, 4);
            __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], qb, k0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], qb, k1);
        }
    }
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(&S[i][jb], _mm512_mul_ps(acc[i][0], scale));
        _mm512_storeu_ps(&S[i][jb + 16], _mm512_mul_ps(acc[i][1], scale));
    }
}

/* O[i] += P[i] · V over nk keys from n0 (V in value pairs `cols` wide; O's rows pad32(cols)
   apart), P given as bfloat16 hi (+ lo when PARTS is 2), for 4 rows at a time and NV
   16-column vectors from c0 (the last ones read under a mask past `cols`). */
TARGET_BF16 static inline __attribute__((always_inline)) void
pv_block(const bf16 *vp, int64_t n0, int64_t nk, const int *live, const bf16 *Ph, const bf16 *Pl,
         float *O, int64_t cols, int i0, int64_t c0, const int NV, const int PARTS) {
    int64_t D = cols, os = pad32(cols);
    __m512 acc[4][4];
    __mmask16 in[4];
    for (int c = 0; c < NV; c++) in[c] = lanes(c0 + 16 * c, 0, cols);
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < NV; c++) acc[i][c] = _mm512_loadu_ps(O + (i0 + i) * os + c0 + 16 * c);
    for (int64_t n2 = 0; n2 < nk / 2; n2++) {
        if (!live[n2 / 16]) { /* P = 0 over the block */
            n2 += 15;
            continue;
        }
        const bf16 *at = vp + ((n0 / 2 + n2) * D + c0) * 2;
        __m512bh vv[4];
        for (int c = 0; c < NV; c++) vv[c] = (__m512bh)_mm512_maskz_loadu_epi32(in[c], at + 32 * c);
        for (int i = 0; i < 4; i++) {
            int32_t hi, lo = 0;
            memcpy(&hi, Ph + (i0 + i) * KT + 2 * n2, 4);
            if (PARTS == 2) memcpy(&lo, Pl + (i0 + i) * KT + 2 * n2, 4);
            __m512bh ph = (__m512bh)_mm512_set1_epi32(hi), pl = (__m512bh)_mm512_set1_epi32(lo);
            for (int c = 0; c < NV; c++) {
                acc[i][c] = _mm512_dpbf16_ps(acc[i][c], ph, vv[c]);
                if (PARTS == 2) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pl, vv[c]);
            }
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(O + (i0 + i) * os + c0 + 16 * c, acc[i][c]);
}

/* The 4 rows from i0 over every column: 64 at a time (the last 64 in part where `cols`
   ends 49 to 63 columns into them), then the whole vectors' worth left. */
TARGET_BF16 static inline __attribute__((always_inline)) void
pv_cols(const bf16 *vp, int64_t n0, int64_t nk, const int *live, const bf16 *Ph, const bf16 *Pl,
        float *O, int64_t cols, int i0, const int PARTS) {
    int64_t c0 = 0;
    for (; c0 + 48 < cols; c0 += 64) pv_block(vp, n0, nk, live, Ph, Pl, O, cols, i0, c0, 4, PARTS);
    int64_t left = (cols - c0 + 15) / 16; /* 0 .. 3 vectors */
    if (left == 1) pv_block(vp, n0, nk, live, Ph, Pl, O, cols, i0, c0, 1, PARTS);
    else if (left == 2) pv_block(vp, n0, nk, live, Ph, Pl, O, cols, i0, c0, 2, PARTS);
    else if (left == 3) pv_block(vp, n0, nk, live, Ph, Pl, O, cols, i0, c0, 3, PARTS);
}

/* O[i] += P[i] · V for the MR rows, V `cols` wide. */
TARGET_BF16 static void pv_bf16(const Job *j, const bf16 *vp, int64_t n0, int64_t nk,
                                const int *live, const bf16 *Ph, const bf16 *Pl, float *O,
                                int64_t cols) {
    for (int i0 = 0; i0 < MR; i0 += 4) {
        if (j->parts == 2) pv_cols(vp, n0, nk, live, Ph, Pl, O, cols, i0, 2);
        else pv_cols(vp, n0, nk, live, Ph, Pl, O, cols, i0, 1);
    }
}

TARGET_BF16 static void probs_bf16(const float *s, int64_t nk, const int *live, float base,
                                   bf16 *ph, bf16 *pl, float *sum, float *seen) {
    __m512 all = _mm512_setzero_ps(), hi = _mm512_setzero_ps(), vb = _mm512_set1_ps(base);
    for (int64_t n = 0; n < nk; n += 32) {
        if (!live[n / 32]) continue;
        __m512 p0 = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + n), vb));
        __m512 p1 = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + n + 16), vb));
        hi = _mm512_add_ps(hi, split(p0, p1, ph + n, pl ? pl + n : NULL));
        all = _mm512_add_ps(all, _mm512_add_ps(p0, p1));
    }
    *sum = _mm512_reduce_add_ps(all);
    *seen = _mm512_reduce_add_ps(hi);
}

/* dS rows (float32, KB keys each) as bfloat16 hi + lo for ·K. */
TARGET_BF16 static void split_rows(const float dS[MR][KB], int64_t nk, bf16 *Dh, bf16 *Dl) {
    for (int i = 0; i < MR; i++)
        for (int64_t n = 0; n < nk; n += 32)
            split(_mm512_loadu_ps(&dS[i][n]), _mm512_loadu_ps(&dS[i][n + 16]), Dh + i * KT + n,
                  Dl + i * KT + n);
}

#endif
