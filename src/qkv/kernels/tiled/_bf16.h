/* The bfloat16 parts of the step where the CPU multiplies bfloat16 pairs into float32 sums
   (AVX512-BF16's VDPBF16PS, ARM's BFDOT): Q, K and V stay bfloat16 and both matmuls run as
   those dot products accumulated in float32; P and dS enter their matmul as bfloat16 hi +
   lo. Written over _simd.h's vbf (32 bfloat16 values, the pairs of a vf's 16 lanes) and
   included before _step.h by the steps whose _simd.h has them (_step512.c, _step128.c and
   _step128_rows2.c); elsewhere (AVX2, clang on ARM) bfloat16 is widened as it is loaded. */
#ifndef QKV_BF16_H
#define QKV_BF16_H
#ifdef QKV_HAS_BF16
#define QKV_BF16 1

/* 32 float32 values as bfloat16 hi (rounded) at hi, and, if lo is given, what hi leaves of
   them rounded again at lo: hi + lo carry about 16 bits. Returns hi's values, lane-wise
   summed over the two halves, as float32. */
TARGET_BF16 static inline vf split(vf p0, vf p1, bf16 *hi, bf16 *lo) {
    const vbf h = vbf_round(p0, p1);
    const vf h0 = vbf_widen(h, 0), h1 = vbf_widen(h, 1);
    vbf_store(hi, h);
    if (lo) vbf_store(lo, vbf_round(vsub(p0, h0), vsub(p1, h1)));
    return vadd(h0, h1);
}

/* S[i][jb..jb+32) = (q_i · k_n) · scale for MR rows (pad32(D) apart; D even) and the 32
   keys of one packed block kb (bfloat16 pairs), BF_DOT_ROWS rows at a time, and each row's
   running lane maximum rmax[i] over them (as dots_f32). (The sums stay
   in local registers until the end: a vector may alias anything, so sums kept in *S would
   be stored and reloaded at every step. S is declared as the pointer it is: GCC 12 would
   not inline SVE's vector functions into this one with S declared as an array.) */
TARGET_BF16 static void dots_bf16(int64_t D, const bf16 *qt, const bf16 *kb, int64_t jb, vf scale,
                                  float (*S)[KT], vf *rmax) {
    const int64_t qs = pad32(D);
    for (int i0 = 0; i0 < MR; i0 += BF_DOT_ROWS) {
        vf acc[BF_DOT_ROWS][2];
        for (int i = 0; i < BF_DOT_ROWS; i++) acc[i][0] = acc[i][1] = vzero();
        for (int64_t d2 = 0; d2 < D / 2; d2++) {
            const bf16 *at = kb + d2 * 64;
            const vbf k0 = vbf_load(at), k1 = vbf_load(at + 32);
            for (int i = 0; i < BF_DOT_ROWS; i++) {
                const vbf qb = vbf_pair(qt + (i0 + i) * qs + 2 * d2);
                acc[i][0] = vdot(acc[i][0], qb, k0);
                acc[i][1] = vdot(acc[i][1], qb, k1);
            }
        }
        for (int i = 0; i < BF_DOT_ROWS; i++) {
            const vf s0 = vmul(acc[i][0], scale), s1 = vmul(acc[i][1], scale);
            vstore(&S[i0 + i][jb], s0);
            vstore(&S[i0 + i][jb + 16], s1);
            if (rmax) rmax[i0 + i] = vmax(vmax(rmax[i0 + i], s0), s1);
        }
    }
}

/* O[i] += P[i] · V over nk keys from n0 (V in value pairs `cols` wide; O's rows pad32(cols)
   apart), P given as bfloat16 hi (+ lo when PARTS is 2), for BF_PV_ROWS rows from i0 and NV
   16-column vectors from c0 (the last ones read under a mask past `cols`). */
TARGET_BF16 static inline __attribute__((always_inline)) void
pv_block(const bf16 *vp, int64_t n0, int64_t nk, const int *live, const bf16 *Ph, const bf16 *Pl,
         float *O, int64_t cols, int i0, int64_t c0, const int NV, const int PARTS) {
    const int64_t os = pad32(cols);
    vf acc[BF_PV_ROWS][BF_PV_COLS];
    lanemask in[BF_PV_COLS];
    for (int c = 0; c < NV; c++) in[c] = lanes(c0 + 16 * c, 0, cols);
    for (int i = 0; i < BF_PV_ROWS; i++)
        for (int c = 0; c < NV; c++) acc[i][c] = vload(O + (i0 + i) * os + c0 + 16 * c);
    for (int64_t n2 = 0; n2 < nk / 2; n2++) {
        if (!live[n2 / 16]) { /* P = 0 over the block */
            n2 += 15;
            continue;
        }
        const bf16 *at = vp + ((n0 / 2 + n2) * cols + c0) * 2;
        vbf vv[BF_PV_COLS];
        for (int c = 0; c < NV; c++) vv[c] = vbf_loadz(in[c], at + 32 * c);
        for (int i = 0; i < BF_PV_ROWS; i++) {
            const vbf ph = vbf_pair(Ph + (i0 + i) * KT + 2 * n2);
            for (int c = 0; c < NV; c++) acc[i][c] = vdot(acc[i][c], ph, vv[c]);
            if (PARTS == 2) {
                const vbf pl = vbf_pair(Pl + (i0 + i) * KT + 2 * n2);
                for (int c = 0; c < NV; c++) acc[i][c] = vdot(acc[i][c], pl, vv[c]);
            }
        }
    }
    for (int i = 0; i < BF_PV_ROWS; i++)
        for (int c = 0; c < NV; c++) vstore(O + (i0 + i) * os + c0 + 16 * c, acc[i][c]);
}

/* The BF_PV_ROWS rows from i0 over every column: BF_PV_COLS vectors at a time (the last
   of them in part where `cols` ends inside it), then the whole vectors' worth left. */
TARGET_BF16 static inline __attribute__((always_inline)) void
pv_cols(const bf16 *vp, int64_t n0, int64_t nk, const int *live, const bf16 *Ph, const bf16 *Pl,
        float *O, int64_t cols, int i0, const int PARTS) {
    int64_t c0 = 0;
    for (; c0 + 16 * (BF_PV_COLS - 1) < cols; c0 += 16 * BF_PV_COLS)
        pv_block(vp, n0, nk, live, Ph, Pl, O, cols, i0, c0, BF_PV_COLS, PARTS);
    const int64_t left = (cols - c0 + 15) / 16; /* 0 .. BF_PV_COLS - 1 vectors */
    if (left == 1) pv_block(vp, n0, nk, live, Ph, Pl, O, cols, i0, c0, 1, PARTS);
#if BF_PV_COLS > 2
    else if (left == 2) pv_block(vp, n0, nk, live, Ph, Pl, O, cols, i0, c0, 2, PARTS);
    else if (left == 3) pv_block(vp, n0, nk, live, Ph, Pl, O, cols, i0, c0, 3, PARTS);
#endif
}

/* O[i] += P[i] · V for the MR rows, V `cols` wide. */
TARGET_BF16 static void pv_bf16(const Job *j, const bf16 *vp, int64_t n0, int64_t nk,
                                const int *live, const bf16 *Ph, const bf16 *Pl, float *O,
                                int64_t cols) {
    for (int i0 = 0; i0 < MR; i0 += BF_PV_ROWS) {
        if (j->parts == 2) pv_cols(vp, n0, nk, live, Ph, Pl, O, cols, i0, 2);
        else pv_cols(vp, n0, nk, live, Ph, Pl, O, cols, i0, 1);
    }
}

/* One row's P = e^(s - base) over the live 32-key blocks of its nk scores, as bfloat16 hi
   at ph (+ lo at pl, if given); *sum: Σ P, *seen: Σ hi (what ·V sees without lo). */
TARGET_BF16 static void probs_bf16(const float *s, int64_t nk, const int *live, float base,
                                   bf16 *ph, bf16 *pl, float *sum, float *seen) {
    vf all = vzero(), hi = vzero();
    const vf by = vset1(base);
    for (int64_t n = 0; n < nk; n += 32) {
        if (!live[n / 32]) continue;
        const vf p0 = exp_neg(vsub(vload(s + n), by)), p1 = exp_neg(vsub(vload(s + n + 16), by));
        hi = vadd(hi, split(p0, p1, ph + n, pl ? pl + n : NULL));
        all = vadd(all, vadd(p0, p1));
    }
    *sum = vsum(all);
    *seen = vsum(hi);
}

/* dS rows (float32, KB keys each) as bfloat16 hi + lo for ·K. */
TARGET_BF16 static void split_rows(const float dS[MR][KB], int64_t nk, bf16 *Dh, bf16 *Dl) {
    for (int i = 0; i < MR; i++)
        for (int64_t n = 0; n < nk; n += 32)
            split(vload(&dS[i][n]), vload(&dS[i][n + 16]), Dh + i * KT + n, Dl + i * KT + n);
}

#endif
#endif
