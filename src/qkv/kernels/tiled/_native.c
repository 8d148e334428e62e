/* qkv's native attention step for x86-64 CPUs with AVX-512: the forward and the backward
   of the tiled kernel's fused calls (qkv/kernels/tiled/flash.py), every call of a pass in
   one parallel region (attend_many, backward_many), in float32 (AVX-512F) or bfloat16
   (AVX512-BF16).

   Forward: softmax(Q Kᵀ · scale + bias) V and its log-sum-exp; the scores, the online
   softmax state and the output accumulate in float32. In float32 both matmuls are float32
   FMAs. In bfloat16, Q, K and V stay bfloat16 and both matmuls run as bfloat16 dot products
   accumulated in float32 (VDPBF16PS); the probabilities enter P·V as two bfloat16 parts,
   hi + lo, so P carries about 16 bits instead of bfloat16's 8: rounding P once to bfloat16
   (what torch's CPU flash kernel does; `parts` = 1 here) breaks qkv's accuracy promise
   (docs/semantics.md) on small sharp problems. Rows with no allowed key give out 0 and lse
   -inf. Work is skipped per 32-key block that no row of an 8-row tile may attend.

   Threads: OpenMP, linked against the libgomp.so.1 torch has already loaded, so the kernel
   runs on torch's own thread pool (threads of a second pool would compete with torch's
   spinning ones for the cores: measured 2× slower calls).

   The module builds without AVX-512 flags: each function is compiled for its target alone
   (TARGET: AVX-512F/BW/DQ/VL; TARGET_BF16: that and AVX512-BF16) and `available()` asks the
   CPU at run time, so the same build imports everywhere and Python falls back to torch's
   flash kernel where the CPU lacks the instructions.

   Layout. q: (B, H, G, R, D) with element strides qs[0..3], D contiguous. In the forward
   K and V come packed once per pass (qkv/kernels/native.py; the backward packs each work
   item's keys itself, from K and V as they are), the 32 keys the score loop takes
   at a time together. bfloat16, in the pairs VDPBF16PS multiplies: kp (B, H, Nt/32, D/2, 32,
   2) and vp (B, H, Nt/2, D, 2), zero past the last key; float32: kp (B, H, Nt/32, D, 32),
   zero past the last key, and vp V itself (D contiguous, rows vs[2] apart, never read past
   a call's keys). Strides ks/vs[0..1] over B and H; a call reads keys k0..k0+N-1 of
   them. bias: float32, (B|1, H|1, G·R, N) with strides bs[0..2] (0 where broadcast), N
   contiguous, or NULL; bounds (instead of a bias, masks whose every row sees one interval
   of keys): int32 (B|1, R, 2), each query position's keys [lo, hi) counted from k0,
   stride bnb over B (0 where broadcast), or NULL; out: float32 (B, H, G, R, D) with
   strides os[0..3], D contiguous; lse: float32 (B, H, G, R) with strides ls[0..3]. D must
   be a multiple of 32. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QKV_X86 1
#include <immintrin.h>
#include "../_exp.h"
#endif

#define MR 8      /* query rows per register tile */
#define KT 128    /* keys per online-softmax step */
#define ROWS 32   /* query rows per work item */
#define MAX_D 256
#define KB 64     /* keys per backward work item */

typedef uint16_t bf16;

/* A key range of a forward job: keys k0..k0+N-1 (begin: k0 rounded down to 32, lead: the
   keys between), with its bias, or its rows' bounds, or neither. */
typedef struct {
    int64_t begin, lead, N;
    const float *bias;
    int64_t bs[3];
    const int32_t *bounds; /* per query position r: the range's keys [lo, hi) it may see */
    int64_t bnb;           /* bounds (B|1, R, 2): the stride over B, 0 where broadcast */
} Seg;

typedef struct {
    const void *q, *kp, *vp; /* bf16 or float (f32) */
    const float *bias;
    const int32_t *bounds; /* as a Seg's */
    int64_t bnb;
    float *out, *lse;
    int64_t qs[4], ks[2], vs[3], bs[3], os[4], ls[4]; /* vs[2]: from key to key of vp */
    int64_t B, H, G, R, D;
    int64_t begin;  /* the first packed key the call reads (a multiple of 32) */
    int64_t lead;   /* keys read before the call's first key (0 to 31) */
    int64_t N;      /* the call's keys */
    float scale;
    int parts;      /* 2: P as bfloat16 hi + lo; 1: hi alone */
    int f32;        /* Q, K, V float32 (else bfloat16) */
    int64_t items, tiles;
    const Seg *segs; /* the forward's key ranges, in order (the fields above: one of them) */
    int64_t nseg;
} Job;

/* A tensor (B, H, T, D), strides xs[0..2] with D contiguous, into the packed layouts above,
   keys T.. zero, 32 keys at a time: `values` 0, the score layout (float32: (D, 32);
   bfloat16: (D/2, 32) pairs), 1, bfloat16's value layout ((16, D, 2)). */
typedef struct {
    const void *x;
    int64_t xs[3];
    void *dst;
    int values;
} Pack;

/* Keys n0..n0+31 of head (b, h) packed at dst. */
static void pack32(const Pack *p, int64_t b, int64_t h, int64_t n0, int64_t T, int64_t D, int f32,
                   void *dst) {
    for (int64_t kk = 0; kk < 32; kk++) {
        int64_t n = n0 + kk, at = b * p->xs[0] + h * p->xs[1] + n * p->xs[2];
        if (f32) {
            const float *xr = (const float *)p->x + at;
            float *kb = dst; /* (D, 32) */
            for (int64_t d = 0; d < D; d++) kb[d * 32 + kk] = n < T ? xr[d] : 0.0f;
        } else if (!p->values) {
            const bf16 *xr = (const bf16 *)p->x + at;
            uint32_t *kb = dst; /* (D/2, 32) pairs */
            for (int64_t d2 = 0; d2 < D / 2; d2++) {
                uint32_t pair = 0;
                if (n < T) memcpy(&pair, xr + 2 * d2, 4);
                kb[d2 * 32 + kk] = pair;
            }
        } else {
            const bf16 *xr = (const bf16 *)p->x + at;
            bf16 *vo = (bf16 *)dst + (kk / 2) * D * 2 + (kk % 2); /* (16, D, 2) */
            for (int64_t d = 0; d < D; d++) vo[2 * d] = n < T ? xr[d] : 0;
        }
    }
}

#ifdef QKV_X86
#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

/* e^x in float32 for x <= 0 (scores minus their running max); exactly 0 below -87, so that
   a masked key (-inf) weighs nothing and a row with none allowed keeps a sum of 0. */
TARGET static inline __m512 exp_neg(__m512 x) {
    __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm512_maskz_mov_ps(keep, qkv_exp16(x));
}

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
        _mm512_storeu_si512(lo, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(p1, h1),
                                                             _mm512_sub_ps(p0, h0)));
    return _mm512_add_ps(h0, h1);
}

/* out[i] = q_i · k_n for MR rows and the 32 keys of one packed block kb (bfloat16 pairs).
   (The sums stay in local registers until the end: __m512 may alias anything, so sums
   kept in *out would be stored and reloaded at every step.) */
TARGET_BF16 static void dots_bf16(const Job *j, const bf16 *qt, const bf16 *kb,
                                  __m512 out[MR][2]) {
    int64_t D = j->D;
    __m512 acc[MR][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t d2 = 0; d2 < D / 2; d2++) {
        const bf16 *at = kb + d2 * 64;
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(at), k1 = (__m512bh)_mm512_loadu_si512(at + 32);
        for (int i = 0; i < MR; i++) {
            int32_t pair;
            memcpy(&pair, qt + i * D + 2 * d2, 4);
            __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], qb, k0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], qb, k1);
        }
    }
    memcpy(out, acc, sizeof acc);
}

/* O[i] += P[i] · V over nk keys from n0, P given as bfloat16 hi (+ lo when PARTS is 2), for
   4 rows at a time and NV 16-column vectors of the head dim at a time. */
TARGET_BF16 static inline __attribute__((always_inline)) void pv_block(
        const Job *j, const bf16 *vp, int64_t n0, int64_t nk, const int *live, const bf16 *Ph,
        const bf16 *Pl, float *O, int i0, int64_t c0, const int NV, const int PARTS) {
    int64_t D = j->D;
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < NV; c++) acc[i][c] = _mm512_loadu_ps(O + (i0 + i) * D + c0 + 16 * c);
    for (int64_t n2 = 0; n2 < nk / 2; n2++) {
        if (!live[n2 / 16]) { /* P = 0 over the block */
            n2 += 15;
            continue;
        }
        const bf16 *at = vp + ((n0 / 2 + n2) * D + c0) * 2;
        __m512bh vv[4];
        for (int c = 0; c < NV; c++) vv[c] = (__m512bh)_mm512_loadu_si512(at + 32 * c);
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
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(O + (i0 + i) * D + c0 + 16 * c, acc[i][c]);
}

TARGET_BF16 static void pv_bf16(const Job *j, const bf16 *vp, int64_t n0, int64_t nk, const int *live,
                      const bf16 *Ph, const bf16 *Pl, float *O) {
    for (int i0 = 0; i0 < MR; i0 += 4) {
        int64_t c0 = 0;
        if (j->parts == 2) {
            for (; c0 + 64 <= j->D; c0 += 64) pv_block(j, vp, n0, nk, live, Ph, Pl, O, i0, c0, 4, 2);
            if (c0 < j->D) pv_block(j, vp, n0, nk, live, Ph, Pl, O, i0, c0, 2, 2); /* D % 64 == 32 */
        } else {
            for (; c0 + 64 <= j->D; c0 += 64) pv_block(j, vp, n0, nk, live, Ph, Pl, O, i0, c0, 4, 1);
            if (c0 < j->D) pv_block(j, vp, n0, nk, live, Ph, Pl, O, i0, c0, 2, 1);
        }
    }
}

/* float32: acc[i] = q_i · k_n as dots_bf16, the block kb (D, 32). */
TARGET static void dots_f32(const Job *j, const float *qt, const float *kb, __m512 out[MR][2]) {
    int64_t D = j->D;
    __m512 acc[MR][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++, kb += 32) {
        __m512 k0 = _mm512_loadu_ps(kb), k1 = _mm512_loadu_ps(kb + 16);
        for (int i = 0; i < MR; i++) {
            __m512 qb = _mm512_set1_ps(qt[i * D + d]);
            acc[i][0] = _mm512_fmadd_ps(qb, k0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(qb, k1, acc[i][1]);
        }
    }
    memcpy(out, acc, sizeof acc);
}

/* float32: O[i] += P[i] · V over the keys n0..n0+last-1 (P's rows `ps` apart, V's rows
   vs[2] apart: V itself, never read past the call's last key), for 4 rows and NV 16-column
   vectors at a time. */
TARGET static inline __attribute__((always_inline)) void pv_block_f32(
        const Job *j, const float *vp, int64_t n0, int64_t last, const int *live, const float *P,
        int64_t ps, float *O, int i0, int64_t c0, const int NV) {
    int64_t D = j->D;
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < NV; c++) acc[i][c] = _mm512_loadu_ps(O + (i0 + i) * D + c0 + 16 * c);
    for (int64_t n = 0; n < last; n++) {
        if (!live[n / 32]) { /* P = 0 over the block */
            n += 31;
            continue;
        }
        const float *at = vp + (n0 + n) * j->vs[2] + c0;
        __m512 vv[4];
        for (int c = 0; c < NV; c++) vv[c] = _mm512_loadu_ps(at + 16 * c);
        for (int i = 0; i < 4; i++) {
            __m512 p = _mm512_set1_ps(P[(i0 + i) * ps + n]);
            for (int c = 0; c < NV; c++) acc[i][c] = _mm512_fmadd_ps(p, vv[c], acc[i][c]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(O + (i0 + i) * D + c0 + 16 * c, acc[i][c]);
}

TARGET static void pv_f32(const Job *j, const float *vp, int64_t n0, int64_t last,
                          const int *live, const float *P, int64_t ps, float *O) {
    for (int i0 = 0; i0 < MR; i0 += 4) {
        int64_t c0 = 0;
        for (; c0 + 64 <= j->D; c0 += 64) pv_block_f32(j, vp, n0, last, live, P, ps, O, i0, c0, 4);
        if (c0 < j->D) pv_block_f32(j, vp, n0, last, live, P, ps, O, i0, c0, 2); /* D % 64 == 32 */
    }
}

/* The element `at` elements past `base` in the call's dtype. */
static inline const void *elem(const Job *j, const void *base, int64_t at) {
    return (const char *)base + at * (j->f32 ? 4 : 2);
}

/* S[i][0..nk) = (q_i · k_n) · by for MR rows (qt, in the call's dtype) and the nk keys from
   n0 (nk: a multiple of 32), -inf over the 32-key blocks not live (no row of the tile may
   attend to them). */
TARGET static void scores(const Job *j, const void *qt, const void *kp, int64_t n0, int64_t nk,
                          const int *live, float by, float S[MR][KT]) {
    __m512 scale = _mm512_set1_ps(by), none = _mm512_set1_ps(-INFINITY), acc[MR][2];
    for (int64_t jb = 0; jb < nk; jb += 32) {
        if (live[jb / 32]) {
            const void *kb = elem(j, kp, (n0 + jb) / 32 * j->D * 32);
            if (j->f32)
                dots_f32(j, qt, kb, acc);
            else
                dots_bf16(j, qt, kb, acc);
        }
        for (int i = 0; i < MR; i++) {
            _mm512_storeu_ps(&S[i][jb], live[jb / 32] ? _mm512_mul_ps(acc[i][0], scale) : none);
            _mm512_storeu_ps(&S[i][jb + 16], live[jb / 32] ? _mm512_mul_ps(acc[i][1], scale) : none);
        }
    }
}

/* One row's P = e^(s - base) over the live 32-key blocks of its nk scores: stored for ·V
   (float32 at pf; or bfloat16 hi at ph and, with parts 2, lo at pl); adds Σ P to *sum and
   Σ of what ·V sees of it to *seen. */
TARGET static void probs_f32(const float *s, int64_t nk, const int *live, float base, float *pf,
                             float *sum, float *seen) {
    __m512 acc = _mm512_setzero_ps(), vb = _mm512_set1_ps(base);
    for (int64_t n = 0; n < nk; n += 16) {
        if (!live[n / 32]) continue;
        __m512 p = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + n), vb));
        _mm512_storeu_ps(pf + n, p);
        acc = _mm512_add_ps(acc, p);
    }
    *sum = *seen = _mm512_reduce_add_ps(acc);
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

/* The lanes of the 16 keys from n that lie in [first, last). */
static inline __mmask16 lanes(int64_t n, int64_t first, int64_t last) {
    int64_t lo = first - n, hi = last - n;
    lo = lo < 0 ? 0 : lo > 16 ? 16 : lo;
    hi = hi < 0 ? 0 : hi > 16 ? 16 : hi;
    return hi <= lo ? 0 : (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
}

/* The keys [*f, *l) of the nk from n0 (counted as first and last are) that row `row` of
   the G·R rows of batch b may attend to: [first, last), narrowed by the row's bounds where
   the range has them. */
static inline void row_keys(const Job *j, int64_t b, int64_t row, int64_t n0, int64_t first,
                            int64_t last, int64_t *f, int64_t *l) {
    *f = first, *l = last;
    if (!j->bounds) return;
    const int32_t *bd = j->bounds + b * j->bnb + 2 * (row % j->R);
    int64_t lo = bd[0] + j->lead - n0, hi = bd[1] + j->lead - n0;
    if (lo > *f) *f = lo;
    if (hi < *l) *l = hi;
}

/* Which 32-key blocks of the nk keys from n0 are live: within [first, last) and allowed to
   one of the tile's `rows` rows (from r0, of batch b) by the row's bounds, or by the bias
   (the bias row of key n at br + n - lead), if there is one. */
TARGET static void live_blocks(const Job *j, int64_t b, const float *bias, int64_t r0, int rows,
                               int64_t n0, int64_t nk, int64_t first, int64_t last, int *live) {
    const __m512 none = _mm512_set1_ps(-INFINITY);
    if (j->bounds) {
        for (int64_t sb = 0; sb < nk / 32; sb++) live[sb] = 0;
        for (int i = 0; i < rows; i++) {
            int64_t f, l;
            row_keys(j, b, r0 + i, n0, first, last, &f, &l);
            for (int64_t sb = f / 32; f < l && sb * 32 < l; sb++) live[sb] = 1;
        }
        return;
    }
    for (int64_t sb = 0; sb < nk / 32; sb++) {
        live[sb] = 0;
        for (int64_t n = sb * 32; n < sb * 32 + 32 && !live[sb]; n += 16) {
            __mmask16 in = lanes(n, first, last);
            if (!bias) live[sb] = in != 0;
            for (int i = 0; bias && in && i < rows && !live[sb]; i++) {
                const float *br = bias + (r0 + i) * j->bs[2] + n0 - j->lead;
                live[sb] = _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, br + n),
                                                   none, _CMP_NEQ_OQ) != 0;
            }
        }
    }
}

/* Rows r0.. of head (b, h)'s G·R rows of x (strides xs over B, H, G, R) into MR rows of
   dst, zero past `rows`. */
static void load_rows(const Job *j, const void *x, const int64_t *xs, int64_t b, int64_t h,
                      int64_t r0, int rows, void *dst) {
    size_t size = (size_t)j->D * (j->f32 ? 4 : 2);
    for (int i = 0; i < MR; i++) {
        int64_t g = (r0 + i) / j->R, r = (r0 + i) % j->R;
        char *to = (char *)dst + i * size;
        if (i < rows)
            memcpy(to, elem(j, x, b * xs[0] + h * xs[1] + g * xs[2] + r * xs[3]), size);
        else
            memset(to, 0, size);
    }
}

/* One tile of MR query rows (rows r0.. of the G·R rows of head (b, h); rows past G·R are
   padding) over the keys of every range of the job, one online softmax: then out and lse. */
TARGET static void row_tile(const Job *job, int64_t b, int64_t h, int64_t r0) {
    int64_t D = job->D, GR = job->G * job->R;
    const __m512 none = _mm512_set1_ps(-INFINITY);
    float qt[MR * MAX_D]; /* Q's rows in the call's dtype */
    float O[MR * MAX_D], S[MR][KT], m[MR], l[MR], lp[MR]; /* lp: the sum of the P ·V sees */
    float Pf[MR * KT];           /* float32 P */
    bf16 Ph[MR * KT], Pl[MR * KT]; /* bfloat16 P: hi, lo */
    int rows = GR - r0 < MR ? (int)(GR - r0) : MR;
    if (rows < MR) { /* padding rows enter ·V as P = 0 */
        memset(Pf, 0, sizeof Pf);
        memset(Ph, 0, sizeof Ph);
        memset(Pl, 0, sizeof Pl);
    }
    load_rows(job, job->q, job->qs, b, h, r0, rows, qt);
    for (int i = 0; i < MR; i++) {
        m[i] = -INFINITY;
        l[i] = lp[i] = 0.0f;
    }
    memset(O, 0, sizeof(float) * MR * D);
    for (int64_t sg = 0; sg < job->nseg; sg++) {
        Job one = *job, *j = &one; /* the job over this range alone */
        const Seg *seg = &job->segs[sg];
        one.begin = seg->begin, one.lead = seg->lead, one.N = seg->N, one.bias = seg->bias;
        one.bounds = seg->bounds, one.bnb = seg->bnb;
        memcpy(one.bs, seg->bs, sizeof one.bs);
        int64_t lead = j->lead, end = lead + j->N, Np = (end + 31) / 32 * 32;
        const void *kp = elem(j, j->kp, b * j->ks[0] + h * j->ks[1] + j->begin * D);
        const void *vp = elem(j, j->vp, b * j->vs[0] + h * j->vs[1] + j->begin * j->vs[2]);
        const float *bias = j->bias ? j->bias + b * j->bs[0] + h * j->bs[1] : NULL;
        for (int64_t n0 = 0; n0 < Np; n0 += KT) {
            int64_t nk = Np - n0 < KT ? Np - n0 : KT;
            int64_t first = lead > n0 ? lead - n0 : 0, last = end - n0 < nk ? end - n0 : nk;
            /* A 32-key block is live if one of the tile's rows may attend to one of its keys;
               the rest is skipped (-inf scores, no ·V). */
            int live[KT / 32];
            live_blocks(j, b, bias, r0, rows, n0, nk, first, last, live);
            scores(j, qt, kp, n0, nk, live, j->scale, S);
            for (int i = 0; i < rows; i++) { /* padding rows (i >= rows) are never written out */
                float *s = S[i];
                const float *br = bias ? bias + (r0 + i) * j->bs[2] + n0 - lead : NULL;
                int64_t kf, kl; /* the keys this row may see */
                row_keys(j, b, r0 + i, n0, first, last, &kf, &kl);
                __m512 mx = none;
                for (int64_t n = 0; n < nk; n += 16) {
                    if (!live[n / 32]) continue;
                    __mmask16 in = lanes(n, kf, kl);
                    __m512 x = _mm512_loadu_ps(s + n);
                    if (br) x = _mm512_mask_add_ps(x, in, x, _mm512_maskz_loadu_ps(in, br + n));
                    x = _mm512_mask_mov_ps(none, in, x); /* keys outside the call */
                    _mm512_storeu_ps(s + n, x);
                    mx = _mm512_max_ps(mx, x);
                }
                float mt = _mm512_reduce_max_ps(mx), mnew = mt > m[i] ? mt : m[i];
                float base = mnew == -INFINITY ? 0.0f : mnew; /* nothing allowed yet: P = 0 */
                float alpha = m[i] == -INFINITY ? 0.0f : expf(m[i] - mnew);
                float sum, seen; /* out is normalised by the P ·V sees, lse keeps float32's */
                if (j->f32)
                    probs_f32(s, nk, live, base, Pf + i * KT, &sum, &seen);
                else
                    probs_bf16(s, nk, live, base, Ph + i * KT, j->parts == 2 ? Pl + i * KT : NULL,
                               &sum, &seen);
                l[i] = l[i] * alpha + sum;
                lp[i] = j->parts == 2 ? l[i] : lp[i] * alpha + seen;
                m[i] = mnew;
                if (alpha != 1.0f) {
                    __m512 va = _mm512_set1_ps(alpha);
                    for (int64_t d = 0; d < D; d += 16)
                        _mm512_storeu_ps(O + i * D + d, _mm512_mul_ps(_mm512_loadu_ps(O + i * D + d), va));
                }
            }
            if (j->f32)
                pv_f32(j, vp, n0, last, live, Pf, KT, O);
            else
                pv_bf16(j, vp, n0, nk, live, Ph, Pl, O);
        }
    }
    for (int i = 0; i < rows; i++) {
        int64_t g = (r0 + i) / job->R, r = (r0 + i) % job->R;
        float *o = job->out + b * job->os[0] + h * job->os[1] + g * job->os[2] + r * job->os[3];
        float inv = lp[i] > 0.0f ? 1.0f / lp[i] : 0.0f;
        for (int64_t d = 0; d < D; d++) o[d] = O[i * D + d] * inv;
        job->lse[b * job->ls[0] + h * job->ls[1] + g * job->ls[2] + r * job->ls[3]] =
            l[i] > 0.0f ? m[i] + logf(l[i]) : -INFINITY;
    }
}

/* Each thread takes work items until none is left. */
/* One forward work item of a call: ROWS query rows of one (b, h). */
static void forward_item(Job *j, int64_t it) {
    int64_t bh = it / j->tiles, r0 = (it % j->tiles) * ROWS, GR = j->G * j->R;
    for (int64_t r = r0; r < r0 + ROWS && r < GR; r += MR) row_tile(j, bh / j->H, bh % j->H, r);
}

/* ---- the backward: dQ, dK, dV of one call, from the whole rows' lse and Delta ----------

   For a block of KB keys and a tile of MR rows: S = Q Kᵀ · scale + bias, P = e^(S - lse),
   dP = dO Vᵀ, dS = P ∘ (dP - Delta) · scale (Delta = rowsum(dO ∘ O)); then dV += Pᵀ dO and
   dK += dSᵀ Q in float32 (P and dS unrounded), dQ += dS K with dS as bfloat16 hi + lo
   (the forward's ·V step). A work item is one key block of one head, over all rows: its
   dK and dV are its own; its share of dQ is added to dq in key-block order (commit), so
   dQ's bits do not depend on which thread ran which block, nor on how many threads ran. */

typedef struct {
    Job f;            /* q; float32: vp K itself (read in place, strides vs); sizes */
    const void *dout; /* dO like q */
    int64_t dos[4];
    Pack k, v, kv;    /* K and V (B, H, T, D) in the score layout, K in bfloat16's value one */
    int64_t T;
    const float *lse, *delta; /* (B, H, G, R) */
    int64_t ls[4], des[4];
    float *dq;        /* (B, H, G, R, D), strides dqs[0..3], D contiguous */
    int64_t dqs[4];
    float *dk, *dv;   /* (B, H, N, D): the call's keys, D contiguous */
    int64_t dks[3], dvs[3];
    int64_t blocks;   /* key blocks per head */
} BJob;

/* acc[n] += Σ_i w[i][n] · x[i] over the tile's rows, for the nk keys of the live blocks:
   4 keys × 32 columns at a time, so that 8 independent FMA chains hide the FMA latency. */
TARGET static void outer(const Job *j, const float W[MR][KB], const float *x, int rows,
                         const int *live, int64_t nk, float *acc) {
    int64_t D = j->D;
    for (int64_t n = 0; n < nk; n += 4) {
        if (!live[n / 32]) continue;
        for (int64_t c = 0; c < D; c += 32) {
            __m512 a[4][2];
            for (int k = 0; k < 4; k++)
                for (int e = 0; e < 2; e++) a[k][e] = _mm512_loadu_ps(acc + (n + k) * D + c + 16 * e);
            for (int i = 0; i < rows; i++) {
                __m512 x0 = _mm512_loadu_ps(x + i * D + c), x1 = _mm512_loadu_ps(x + i * D + c + 16);
                for (int k = 0; k < 4; k++) {
                    __m512 w = _mm512_set1_ps(W[i][n + k]);
                    a[k][0] = _mm512_fmadd_ps(w, x0, a[k][0]);
                    a[k][1] = _mm512_fmadd_ps(w, x1, a[k][1]);
                }
            }
            for (int k = 0; k < 4; k++)
                for (int e = 0; e < 2; e++) _mm512_storeu_ps(acc + (n + k) * D + c + 16 * e, a[k][e]);
        }
    }
}

/* One work item: the key block of KB keys from n0 (of the call's, counted from begin) of
   head (b, h), over all the call's rows. Its keys are packed here, into the thread's
   `scratch` (3 · KB · D floats): no pass packs all of K and V beforehand. */
TARGET static void key_block(BJob *bj, int64_t b, int64_t h, int64_t n0, float *dq,
                             float *dKa, float *dVa, void *scratch) {
    Job *j = &bj->f; /* dq: this item's (G, R, D) share */
    int64_t D = j->D, GR = j->G * j->R;
    int64_t lead = j->lead, end = lead + j->N, Np = (end + 31) / 32 * 32;
    int64_t nk = Np - n0 < KB ? Np - n0 : KB;
    int64_t first = lead > n0 ? lead - n0 : 0, last = end - n0 < nk ? end - n0 : nk;
    size_t size = j->f32 ? 4 : 2;
    char *kp = scratch, *vk = kp + KB * D * size, *kvb = vk + KB * D * size;
    for (int64_t s = 0; s < nk; s += 32) { /* K and V from key begin + n0, zero past T */
        pack32(&bj->k, b, h, j->begin + n0 + s, bj->T, D, j->f32, kp + s * D * size);
        pack32(&bj->v, b, h, j->begin + n0 + s, bj->T, D, j->f32, vk + s * D * size);
        if (!j->f32) pack32(&bj->kv, b, h, j->begin + n0 + s, bj->T, D, 0, kvb + s * D * size);
    }
    const void *kv = elem(j, j->vp, b * j->vs[0] + h * j->vs[1] + j->begin * j->vs[2]);
    const float *bias = j->bias ? j->bias + b * j->bs[0] + h * j->bs[1] : NULL;
    bf16 qt[MR * MAX_D], dt[MR * MAX_D], Dh[MR * KT], Dl[MR * KT];
    float qf[MR * MAX_D], df[MR * MAX_D], S[MR][KT], dP[MR][KT], P[MR][KB], dS[MR][KB];
    const void *qrows = j->f32 ? (void *)qf : qt, *drows = j->f32 ? (void *)df : dt;
    float O[MR * MAX_D];
    memset(dKa, 0, sizeof(float) * KB * D);
    memset(dVa, 0, sizeof(float) * KB * D);
    for (int64_t r0 = 0; r0 < GR; r0 += MR) {
        int rows = GR - r0 < MR ? (int)(GR - r0) : MR;
        int live[KT / 32], any = 0;
        live_blocks(j, b, bias, r0, rows, n0, nk, first, last, live);
        for (int64_t sb = 0; sb < nk / 32; sb++) any |= live[sb];
        if (!any) continue;
        load_rows(j, j->q, j->qs, b, h, r0, rows, (void *)qrows);
        load_rows(j, bj->dout, bj->dos, b, h, r0, rows, (void *)drows);
        for (int64_t x = 0; !j->f32 && x < MR * D; x++) { /* float32 copies for dK and dV */
            uint32_t uq = (uint32_t)qt[x] << 16, ud = (uint32_t)dt[x] << 16;
            memcpy(qf + x, &uq, 4);
            memcpy(df + x, &ud, 4);
        }
        scores(j, qrows, kp, 0, nk, live, j->scale, S);
        scores(j, drows, vk, 0, nk, live, 1.0f, dP);
        const __m512 none = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps();
        const __m512 scale = _mm512_set1_ps(j->scale);
        for (int i = 0; i < MR; i++) {
            int64_t g = (r0 + i) / j->R, r = (r0 + i) % j->R;
            float lse = i < rows ? bj->lse[b * bj->ls[0] + h * bj->ls[1] + g * bj->ls[2] +
                                           r * bj->ls[3]] : -INFINITY;
            float delta = i < rows ? bj->delta[b * bj->des[0] + h * bj->des[1] +
                                               g * bj->des[2] + r * bj->des[3]] : 0.0f;
            const float *br = bias && i < rows ? bias + (r0 + i) * j->bs[2] + n0 - lead : NULL;
            int64_t kf, kl; /* the keys this row may see */
            row_keys(j, b, r0 + i, n0, first, last, &kf, &kl);
            for (int64_t n = 0; n < nk; n += 16) {
                __m512 p = zero, ds = zero;
                if (live[n / 32] && lse != -INFINITY) { /* a row with no key: P = 0 */
                    __mmask16 in = lanes(n, kf, kl);
                    __m512 x = _mm512_loadu_ps(&S[i][n]);
                    if (br) x = _mm512_mask_add_ps(x, in, x, _mm512_maskz_loadu_ps(in, br + n));
                    x = _mm512_mask_mov_ps(none, in, x);
                    p = exp_neg(_mm512_sub_ps(x, _mm512_set1_ps(lse)));
                    ds = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(
                        _mm512_loadu_ps(&dP[i][n]), _mm512_set1_ps(delta))), scale);
                }
                _mm512_storeu_ps(&P[i][n], p);
                _mm512_storeu_ps(&dS[i][n], ds);
            }
        }
        outer(j, P, df, rows, live, nk, dVa);
        outer(j, dS, qf, rows, live, nk, dKa);
        memset(O, 0, sizeof(float) * MR * D);
        if (j->f32) {
            pv_f32(j, kv, n0, last, live, &dS[0][0], KB, O);
        } else { /* dS enters ·K as bfloat16 hi + lo */
            split_rows(dS, nk, Dh, Dl);
            pv_bf16(j, (const bf16 *)kvb, 0, nk, live, Dh, Dl, O);
        }
        for (int i = 0; i < rows; i++) {
            int64_t g = (r0 + i) / j->R, r = (r0 + i) % j->R;
            float *dqr = dq + (g * j->R + r) * D;
            for (int64_t d = 0; d < D; d++) dqr[d] += O[i * D + d];
        }
    }
}

/* An item's shares (dQ of every row; dK and dV of its key block) added to the call's dq,
   dk and dv. */
static void add_share(const BJob *bj, int64_t b, int64_t h, int64_t n0, const float *dq,
                      const float *dKa, const float *dVa) {
    const Job *j = &bj->f;
    int64_t D = j->D, lead = j->lead, end = lead + j->N, Np = (end + 31) / 32 * 32;
    int64_t nk = Np - n0 < KB ? Np - n0 : KB;
    int64_t first = lead > n0 ? lead - n0 : 0, last = end - n0 < nk ? end - n0 : nk;
    for (int64_t g = 0; g < j->G; g++)
        for (int64_t r = 0; r < j->R; r++) {
            float *dqr = bj->dq + b * bj->dqs[0] + h * bj->dqs[1] + g * bj->dqs[2] +
                         r * bj->dqs[3];
            const float *src = dq + (g * j->R + r) * D;
            for (int64_t d = 0; d < D; d++) dqr[d] += src[d];
        }
    for (int64_t n = first; n < last; n++) { /* the call's key n - lead */
        float *dk = bj->dk + b * bj->dks[0] + h * bj->dks[1] + (n0 + n - lead) * bj->dks[2];
        float *dv = bj->dv + b * bj->dvs[0] + h * bj->dvs[1] + (n0 + n - lead) * bj->dvs[2];
        for (int64_t d = 0; d < D; d++) {
            dk[d] += dKa[n * D + d];
            dv[d] += dVa[n * D + d];
        }
    }
}

/* A backward pass: every call's work items (one key block of one (b, h) each) dealt from
   one counter in one parallel region. An item computes its shares into a buffer of its own;
   the shares are added to dq, dk and dv in one fixed order per (b, h) — call by call, key
   block by key block — by whichever thread holds the lock when the share before it is in:
   no race where two calls' keys overlap, no waiting for a slower thread's item, and the
   same bits whatever the threads did. */
typedef struct {
    float *mem;        /* dQ share (G·R·D), then dK and dV (KB·D each) */
    int64_t call, n0;
} Share;

typedef struct {
    BJob *calls;
    int64_t n, B, H;
    int64_t *start;     /* the calls' first items (n + 1) */
    int64_t *chain0;    /* each call's first place in a (b, h)'s order */
    int64_t chain;      /* places in each (b, h)'s order: every call's key blocks */
    Share *pending;     /* (B·H) × chain; mem NULL until the share is in */
    int64_t *committed; /* per (b, h): the places added so far */
    omp_lock_t lock;
    int64_t next, done;
} Pass;

static void commit(Pass *ps, int64_t bh, int64_t place, Share share) {
    omp_set_lock(&ps->lock);
    ps->pending[bh * ps->chain + place] = share;
    for (Share *s; ps->committed[bh] < ps->chain &&
                   (s = &ps->pending[bh * ps->chain + ps->committed[bh]])->mem;) {
        const BJob *bj = &ps->calls[s->call];
        int64_t D = bj->f.D, q = bj->f.G * bj->f.R * D;
        add_share(bj, bh / ps->H, bh % ps->H, s->n0, s->mem, s->mem + q, s->mem + q + KB * D);
        free(s->mem);
        s->mem = NULL;
        ps->committed[bh]++;
    }
    omp_unset_lock(&ps->lock);
}

static void backward_worker(Pass *ps) {
    int64_t items = ps->start[ps->n], c = 0;
    void *scratch = malloc(3 * KB * MAX_D * sizeof(float)); /* this thread's packed keys */
    for (int64_t it; (it = __atomic_fetch_add(&ps->next, 1, __ATOMIC_RELAXED)) < items;) {
        while (it >= ps->start[c + 1]) c++; /* a thread's items only grow */
        BJob *bj = &ps->calls[c];
        int64_t local = it - ps->start[c], bh = local / bj->blocks, kb = local % bj->blocks;
        int64_t D = bj->f.D, q = bj->f.G * bj->f.R * D;
        float *mem = calloc((size_t)(q + 2 * KB * D), sizeof(float));
        if (!mem || !scratch) { /* (its item is not done: the caller raises) */
            free(mem);
            break;
        }
        key_block(bj, bh / ps->H, bh % ps->H, kb * KB, mem, mem + q, mem + q + KB * D, scratch);
        commit(ps, bh, ps->chain0[c] + kb, (Share){mem, c, kb * KB});
        __atomic_fetch_add(&ps->done, 1, __ATOMIC_RELAXED);
    }
    free(scratch);
}
#endif /* QKV_X86 */

/* Packs block `it` of B·H·(Nt/32): 32 keys of one head. */
static void pack_block(const Pack *p, int64_t it, int64_t H, int64_t T, int64_t D,
                       int64_t Nt, int f32) {
    int64_t bh = it / (Nt / 32), nb = it % (Nt / 32);
    pack32(p, bh / H, bh % H, nb * 32, T, D, f32, (char *)p->dst + it * 32 * D * (f32 ? 4 : 2));
}

/* Every pack of a pass in one parallel region. */
static void pack_all(const Pack *packs, int64_t n, int64_t B, int64_t H, int64_t T, int64_t D,
                     int64_t Nt, int threads, int f32) {
    int64_t blocks = B * H * (Nt / 32);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
    for (int64_t it = 0; it < n * blocks; it++)
        pack_block(&packs[it / blocks], it % blocks, H, T, D, Nt, f32);
}

static PyObject *pack_py(PyObject *self, PyObject *args) {
    PyObject *list;
    long long B, H, T, D, Nt;
    int threads, f32;
    if (!PyArg_ParseTuple(args, "O!(LLLLL)ip", &PyList_Type, &list, &B, &H, &T, &D, &Nt,
                          &threads, &f32))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (D % 2 != 0 || Nt % 32 != 0 || Nt < T || threads < 1 || n > 8) {
        PyErr_SetString(PyExc_ValueError, "pack: D even, Nt a multiple of 32 covering T, "
                        "at most 8 packs");
        return NULL;
    }
    Pack packs[8];
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long x, dst;
        long long xs0, xs1, xs2;
        int values;
        PyObject *one = PyList_GET_ITEM(list, i);
        if (!PyTuple_Check(one) ||
            !PyArg_ParseTuple(one, "(KLLL)Kp", &x, &xs0, &xs1, &xs2, &dst, &values)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "pack: a tuple a pack");
            return NULL;
        }
        packs[i] = (Pack){(const void *)(uintptr_t)x, {xs0, xs1, xs2}, (void *)(uintptr_t)dst,
                          values && !f32};
    }
    Py_BEGIN_ALLOW_THREADS
    pack_all(packs, n, B, H, T, D, Nt, threads, f32);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Whether the n values at x (float32, else bfloat16) are all finite (no exponent all ones):
   one thread, no parallel region, so that on a busy machine no descheduled thread holds the
   check up; chunk by chunk, stopping at the first chunk that holds NaN or inf. */
static int all_finite(const void *x, int64_t n, int f32) {
    const int64_t chunk = 1 << 14;
    for (int64_t i0 = 0; i0 < n; i0 += chunk) {
        int64_t i1 = n - i0 < chunk ? n : i0 + chunk;
        unsigned bad = 0;
        if (f32) {
            const uint32_t *u = (const uint32_t *)x;
            for (int64_t i = i0; i < i1; i++) bad |= (u[i] & 0x7f800000u) == 0x7f800000u;
        } else {
            const uint16_t *u = (const uint16_t *)x;
            for (int64_t i = i0; i < i1; i++) bad |= (u[i] & 0x7f80u) == 0x7f80u;
        }
        if (bad) return 0;
    }
    return 1;
}

static PyObject *finite_py(PyObject *self, PyObject *args) {
    unsigned long long x;
    long long n;
    int f32, found;
    if (!PyArg_ParseTuple(args, "KLp", &x, &n, &f32)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    found = all_finite((const void *)(uintptr_t)x, n, f32);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(found);
}

/* Whether this CPU runs the kernel in float32 (AVX-512F/BW/DQ/VL) or, f32 = 0, in bfloat16
   (that and AVX512-BF16). */
static int cpu_runs(int f32) {
#ifdef QKV_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           (f32 || __builtin_cpu_supports("avx512bf16"));
#else
    return 0;
#endif
}

static PyObject *available(PyObject *self, PyObject *args) {
    int f32;
    if (!PyArg_ParseTuple(args, "p", &f32)) return NULL;
    return PyBool_FromLong(cpu_runs(f32));
}

/* Checks one call's sizes and fills them into j; 0 with a Python error set if they do not
   fit the kernel or the CPU lacks the instructions. */
static int call_sizes(Job *j, const char *name, long long B, long long H, long long G,
                      long long R, long long D, double scale, int f32, int threads) {
    if (!cpu_runs(f32)) {
        PyErr_SetString(PyExc_RuntimeError, f32 ? "this CPU has no AVX-512"
                                                : "this CPU has no AVX512-BF16");
        return 0;
    }
    if (D % 32 != 0 || D > MAX_D || D <= 0 || R <= 0 || G <= 0 || threads < 1) {
        PyErr_Format(PyExc_ValueError, "%s: D must be a positive multiple of 32 up to 256",
                     name);
        return 0;
    }
    j->B = B, j->H = H, j->G = G, j->R = R, j->D = D;
    j->scale = (float)scale;
    j->f32 = f32;
    return 1;
}

/* Keys k0..k0+N-1 as a range of packed buffers of Nt keys; 0 with a Python error set if
   they do not lie within them. */
static int key_range(Seg *s, const char *name, long long Nt, long long k0, long long N) {
    int64_t begin = k0 / 32 * 32, lead = k0 - begin;
    if (N <= 0 || k0 < 0 || Nt % 32 != 0 || begin + (lead + N + 31) / 32 * 32 > Nt) {
        PyErr_Format(PyExc_ValueError, "%s: the call's keys must lie within the packed "
                     "buffers", name);
        return 0;
    }
    s->begin = begin, s->lead = lead, s->N = N;
    return 1;
}

/* One call's arguments (attend's, less the thread count) into j; 0 with a Python error
   set if they do not parse or fit. */
static int parse_call(Job *j, PyObject *args, int threads) {
    unsigned long long q, kp, vp, out, lse;
    long long qs0, qs1, qs2, qs3, ks0, ks1, vs0, vs1, vs2, os0, os1, os2, os3, ls0, ls1, ls2,
        ls3;
    long long B, H, G, R, D, Nt;
    double scale;
    int parts, f32;
    PyObject *ranges;
    memset(j, 0, sizeof *j);
    if (!PyArg_ParseTuple(args, "(KLLLL)(KLL)(KLLL)O!(KLLLL)(KLLLL)(LLLLL)Ldip", &q, &qs0, &qs1,
                          &qs2, &qs3, &kp, &ks0, &ks1, &vp, &vs0, &vs1, &vs2, &PyList_Type, &ranges,
                          &out, &os0, &os1, &os2, &os3, &lse, &ls0, &ls1, &ls2, &ls3, &B, &H, &G,
                          &R, &D, &Nt, &scale, &parts, &f32))
        return 0;
    if (!call_sizes(j, "attend", B, H, G, R, D, scale, f32, threads)) return 0;
    Py_ssize_t n = PyList_GET_SIZE(ranges);
    Seg *segs = calloc(n > 0 ? (size_t)n : 1, sizeof(Seg));
    if (!segs) {
        PyErr_NoMemory();
        return 0;
    }
    j->segs = segs, j->nseg = n; /* the caller frees them */
    for (Py_ssize_t s = 0; s < n; s++) {
        unsigned long long bias, bounds;
        long long k0, N, bs0, bs1, bs2, bnb;
        PyObject *one = PyList_GET_ITEM(ranges, s);
        if (!PyTuple_Check(one) ||
            !PyArg_ParseTuple(one, "LL(KLLL)(KL)", &k0, &N, &bias, &bs0, &bs1, &bs2, &bounds,
                              &bnb) ||
            !key_range(&segs[s], "attend", Nt, k0, N)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "attend: (k0, N, bias, bounds) a range");
            return 0;
        }
        segs[s].bias = (const float *)(uintptr_t)bias;
        segs[s].bounds = (const int32_t *)(uintptr_t)bounds, segs[s].bnb = bnb;
        segs[s].bs[0] = bs0, segs[s].bs[1] = bs1, segs[s].bs[2] = bs2;
    }
#ifdef QKV_X86
    j->q = (const void *)(uintptr_t)q;
    j->kp = (const void *)(uintptr_t)kp;
    j->vp = (const void *)(uintptr_t)vp;
    j->out = (float *)(uintptr_t)out;
    j->lse = (float *)(uintptr_t)lse;
    int64_t qs[4] = {qs0, qs1, qs2, qs3}, ks[2] = {ks0, ks1}, vs[3] = {vs0, vs1, vs2},
            os[4] = {os0, os1, os2, os3}, ls[4] = {ls0, ls1, ls2, ls3};
    memcpy(j->os, os, sizeof os);
    memcpy(j->ls, ls, sizeof ls);
    memcpy(j->qs, qs, sizeof qs);
    memcpy(j->ks, ks, sizeof ks);
    memcpy(j->vs, vs, sizeof vs);
    j->parts = parts == 1 ? 1 : 2;
    j->tiles = (G * R + ROWS - 1) / ROWS;
    j->items = B * H * j->tiles;
#endif
    return 1;
}

/* Every call of a forward pass in one parallel region: the calls' work items are dealt
   from one counter, so a thread that is descheduled (a busy machine) holds up the one item
   it is on, and the pass waits at one barrier instead of one per call. */
static PyObject *run_calls(PyObject *list, int threads) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (threads < 1) {
        PyErr_SetString(PyExc_ValueError, "attend_many: threads must be >= 1");
        return NULL;
    }
    Job *jobs = calloc(n > 0 ? (size_t)n : 1, sizeof(Job));
    int64_t *start = calloc((size_t)n + 1, sizeof(int64_t));
    if (!jobs || !start) {
        free(jobs), free(start);
        return PyErr_NoMemory();
    }
    PyObject *failed = NULL;
    for (Py_ssize_t c = 0; c < n && !failed; c++) {
        PyObject *one = PyList_GET_ITEM(list, c);
        if (!PyTuple_Check(one) || !parse_call(&jobs[c], one, threads)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "attend_many: a tuple a call");
            failed = Py_None;
        }
        start[c + 1] = start[c] + jobs[c].items;
    }
    if (failed) {
        for (Py_ssize_t c = 0; c < n; c++) free((void *)jobs[c].segs);
        free(jobs), free(start);
        return NULL;
    }
#ifdef QKV_X86
    int64_t next = 0, items = start[n];
    if (threads > items) threads = items > 0 ? (int)items : 1;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads)
    {
        Py_ssize_t c = 0; /* each thread's items only grow: its call index only moves on */
        for (int64_t it; (it = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED)) < items;) {
            while (it >= start[c + 1]) c++;
            forward_item(&jobs[c], it - start[c]);
        }
    }
    Py_END_ALLOW_THREADS
#endif
    for (Py_ssize_t c = 0; c < n; c++) free((void *)jobs[c].segs);
    free(jobs), free(start);
    Py_RETURN_NONE;
}

typedef PyObject *(*Runner)(PyObject *list, int threads);

/* A list of calls and a thread count, run. */
static PyObject *many(PyObject *args, Runner run) {
    PyObject *list;
    int threads;
    if (!PyArg_ParseTuple(args, "O!i", &PyList_Type, &list, &threads)) return NULL;
    return run(list, threads);
}

/* One call's arguments and a thread count: run as a list of one. */
static PyObject *one(PyObject *args, Runner run) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    int threads = n > 0 ? (int)PyLong_AsLong(PyTuple_GET_ITEM(args, n - 1)) : 0;
    if (PyErr_Occurred()) return NULL;
    PyObject *call = PyTuple_GetSlice(args, 0, n > 0 ? n - 1 : 0);
    PyObject *list = call ? PyList_New(1) : NULL;
    if (!list) {
        Py_XDECREF(call);
        return NULL;
    }
    PyList_SET_ITEM(list, 0, call); /* the list owns the call now */
    PyObject *done = run(list, threads);
    Py_DECREF(list);
    return done;
}

static PyObject *attend_many(PyObject *self, PyObject *args) { return many(args, run_calls); }
static PyObject *attend(PyObject *self, PyObject *args) { return one(args, run_calls); }

/* One backward call's arguments (backward's, less the thread count) into bj; 0 with a
   Python error set if they do not parse or fit. */
static int parse_backward(BJob *bj, PyObject *args, int threads) {
    unsigned long long q, dout, k, v, bias, bounds, lse, delta, dq, dk, dv;
    long long qs[4], dos[4], kst[3], vst[3], bs[3], bnb, ls[4], des[4], dqs[4], dks[3], dvs[3];
    long long B, H, G, R, D, T, k0, N;
    double scale;
    int f32;
    if (!PyArg_ParseTuple(args, "(KLLLL)(KLLLL)(KLLL)(KLLL)(KLLL)(KL)(KLLLL)(KLLLL)(KLLLL)(KLLL)"
                          "(KLLL)(LLLLL)(LLL)dp", &q, &qs[0], &qs[1], &qs[2], &qs[3], &dout,
                          &dos[0], &dos[1], &dos[2], &dos[3], &k, &kst[0], &kst[1], &kst[2], &v,
                          &vst[0], &vst[1], &vst[2], &bias, &bs[0], &bs[1], &bs[2], &bounds, &bnb,
                          &lse, &ls[0], &ls[1], &ls[2], &ls[3], &delta, &des[0], &des[1], &des[2],
                          &des[3], &dq, &dqs[0], &dqs[1], &dqs[2], &dqs[3], &dk, &dks[0], &dks[1],
                          &dks[2], &dv, &dvs[0], &dvs[1], &dvs[2], &B, &H, &G, &R, &D, &T, &k0, &N,
                          &scale, &f32))
        return 0;
    memset(bj, 0, sizeof *bj);
    Job *j = &bj->f;
    Seg keys;
    if (!call_sizes(j, "backward", B, H, G, R, D, scale, f32, threads) ||
        !key_range(&keys, "backward", T < 0 ? 0 : (T + 31) / 32 * 32 + 32, k0, N))
        return 0;
    if (k0 + N > T) {
        PyErr_SetString(PyExc_ValueError, "backward: the call's keys must lie within K and V");
        return 0;
    }
    j->begin = keys.begin, j->lead = keys.lead, j->N = keys.N;
    j->q = (const void *)(uintptr_t)q;
    j->vp = (const void *)(uintptr_t)k; /* float32 reads K's rows in place for dS K */
    j->bias = (const float *)(uintptr_t)bias;
    j->bounds = (const int32_t *)(uintptr_t)bounds, j->bnb = bnb;
    bj->dout = (const void *)(uintptr_t)dout;
    bj->k = (Pack){(const void *)(uintptr_t)k, {kst[0], kst[1], kst[2]}, NULL, 0};
    bj->v = (Pack){(const void *)(uintptr_t)v, {vst[0], vst[1], vst[2]}, NULL, 0};
    bj->kv = bj->k, bj->kv.values = 1;
    bj->T = T;
    bj->lse = (const float *)(uintptr_t)lse;
    bj->delta = (const float *)(uintptr_t)delta;
    bj->dq = (float *)(uintptr_t)dq;
    bj->dk = (float *)(uintptr_t)dk;
    bj->dv = (float *)(uintptr_t)dv;
    for (int x = 0; x < 4; x++) {
        j->qs[x] = qs[x], bj->dos[x] = dos[x], bj->ls[x] = ls[x], bj->des[x] = des[x];
        bj->dqs[x] = dqs[x];
    }
    for (int x = 0; x < 3; x++)
        j->bs[x] = bs[x], bj->dks[x] = dks[x], bj->dvs[x] = dvs[x], j->vs[x] = kst[x];
    j->parts = 2;
    bj->blocks = ((j->lead + N + 31) / 32 * 32 + KB - 1) / KB;
    return 1;
}

/* Every call of a backward pass (one B, H) in one parallel region; see Pass. */
static PyObject *run_backward(PyObject *list, int threads) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (threads < 1) {
        PyErr_SetString(PyExc_ValueError, "backward: threads must be >= 1");
        return NULL;
    }
    Pass ps = {0};
    ps.n = n;
    ps.calls = calloc(n > 0 ? (size_t)n : 1, sizeof(BJob));
    ps.start = calloc((size_t)n + 1, sizeof(int64_t));
    ps.chain0 = calloc((size_t)n + 1, sizeof(int64_t));
    PyObject *failed = NULL;
    if (!ps.calls || !ps.start || !ps.chain0) failed = PyErr_NoMemory();
    for (Py_ssize_t c = 0; !failed && c < n; c++) {
        PyObject *one = PyList_GET_ITEM(list, c);
        if (!PyTuple_Check(one) || !parse_backward(&ps.calls[c], one, threads)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "backward: a tuple a call");
            failed = Py_None;
            break;
        }
        BJob *bj = &ps.calls[c];
        if (c == 0) ps.B = bj->f.B, ps.H = bj->f.H;
        if (bj->f.B != ps.B || bj->f.H != ps.H) {
            PyErr_SetString(PyExc_ValueError, "backward: the calls of a pass share B and H");
            failed = Py_None;
            break;
        }
        ps.start[c + 1] = ps.start[c] + ps.B * ps.H * bj->blocks;
        ps.chain0[c + 1] = ps.chain0[c] + bj->blocks;
    }
    if (!failed) {
        ps.chain = ps.chain0[n];
        ps.pending = calloc((size_t)(ps.B * ps.H * ps.chain > 0 ? ps.B * ps.H * ps.chain : 1),
                            sizeof(Share));
        ps.committed = calloc((size_t)(ps.B * ps.H > 0 ? ps.B * ps.H : 1), sizeof(int64_t));
        if (!ps.pending || !ps.committed) failed = PyErr_NoMemory();
    }
    if (!failed) {
#ifdef QKV_X86
        int64_t items = ps.start[n];
        if (threads > items) threads = items > 0 ? (int)items : 1;
        omp_init_lock(&ps.lock);
        Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads)
        backward_worker(&ps);
        Py_END_ALLOW_THREADS
        omp_destroy_lock(&ps.lock);
        for (int64_t i = 0; i < ps.B * ps.H * ps.chain; i++) free(ps.pending[i].mem);
        if (ps.done != items) failed = PyErr_NoMemory(); /* an item found no memory */
#endif
    }
    free(ps.calls), free(ps.start), free(ps.chain0), free(ps.pending), free(ps.committed);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

static PyObject *backward_many(PyObject *self, PyObject *args) {
    return many(args, run_backward);
}
static PyObject *backward_py(PyObject *self, PyObject *args) { return one(args, run_backward); }

static PyMethodDef methods[] = {
    {"available", available, METH_VARARGS,
     "available(float32): whether this CPU runs the kernel in float32 (AVX-512) or in "
     "bfloat16 (AVX512-BF16)."},
    {"finite", finite_py, METH_VARARGS,
     "finite(x, n, float32): whether n contiguous float32 (else bfloat16) values at x are "
     "all finite, in one thread."},
    {"backward_many", backward_many, METH_VARARGS,
     "backward_many([call, ...], threads): every call (backward's arguments less threads, "
     "one B and H) in one parallel region, the gradients added in one fixed order."},
    {"backward", backward_py, METH_VARARGS,
     "backward((q, *4), (dout, *4), (k, *3), (v, *3), (bias|0, *3), (bounds|0, *1), "
     "(lse, *4), (delta, *4), (dq, *4), (dk, *3), (dv, *3), (B, H, G, R, D), (T, k0, N), "
     "scale, float32, threads): one call's gradients, added to dq (B, H, G, R, D; in "
     "key-block order), dk and dv; K and V (B, H, T, D) as they are."},
    {"pack", pack_py, METH_VARARGS,
     "pack([((x, *3 strides), dst, values), ...], (B, H, T, D, Nt), threads, float32): "
     "tensors into the kernel's score layout (values 0) or bfloat16's value layout (1), in "
     "one parallel region."},
    {"attend_many", attend_many, METH_VARARGS,
     "attend_many([call, ...], threads): every call (attend's arguments less threads) in one "
     "parallel region, their work items dealt from one counter."},
    {"attend", attend, METH_VARARGS,
     "attend((q, *4 strides), (kp, *2), (vp, *2), [(k0, N, (bias|0, *3)), ...], (out, *4), "
     "(lse, *4), (B, H, G, R, D), Nt, scale, parts, float32, threads): one call of the step "
     "over key ranges of the packed buffers (one online softmax across them), into out and "
     "lse (float32)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "qkv's native attention step (AVX-512; bfloat16: AVX512-BF16).",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
