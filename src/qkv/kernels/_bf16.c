/* qkv's native bfloat16 attention step for x86-64 CPUs with AVX512-BF16.

   softmax(Q Kᵀ · scale + bias) V and its log-sum-exp over one call of the tiled kernel's
   fused forward (qkv/kernels/fused.py): Q, K, V stay bfloat16 and both matmuls run as
   bfloat16 dot products accumulated in float32 (VDPBF16PS); the scores, the online softmax
   state and the output accumulate in float32. The probabilities enter P·V as two bfloat16
   parts, hi + lo, so P carries about 16 bits instead of bfloat16's 8: rounding P once to
   bfloat16 (what torch's CPU flash kernel does) would break qkv's accuracy promise
   (docs/semantics.md). Rows with no allowed key give out 0 and lse -inf.

   Threads: OpenMP, linked against the libgomp.so.1 torch has already loaded, so the kernel
   runs on torch's own thread pool (threads of a second pool would compete with torch's
   spinning ones for the cores: measured 2× slower calls).

   The module builds without AVX512 flags: the kernel is compiled for that target alone and
   `available()` asks the CPU at run time, so the same build imports everywhere and Python
   falls back to the float32 path where the CPU lacks the instructions.

   Layout. q: (B, H, G, R, D) with element strides qs[0..3], D contiguous. K and V come
   packed once per forward pass (qkv/kernels/native.py) in the pairs VDPBF16PS multiplies:
   kp (B, H, Nt/32, D/2, 32, 2) and vp (B, H, Nt/2, D, 2), zero past the last key: the 32
   keys the score loop takes at a time lie together. Strides
   ks/vs[0..1] over B and H; a call reads keys k0..k0+N-1 of them. bias: float32, (B|1, H|1,
   G·R, N) with strides bs[0..2] (0 where broadcast), N contiguous, or NULL; out: float32
   (B, H, G, R, D) contiguous; lse: float32 (B, H, G, R). D must be a multiple of 32. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QKV_X86 1
#include <immintrin.h>
#endif

#define MR 8      /* query rows per register tile */
#define KT 128    /* keys per online-softmax step */
#define ROWS 32   /* query rows per work item */
#define MAX_D 256

typedef uint16_t bf16;

typedef struct {
    const bf16 *q, *kp, *vp;
    const float *bias;
    float *out, *lse;
    int64_t qs[4], ks[2], vs[2], bs[3];
    int64_t B, H, G, R, D;
    int64_t Nt;     /* keys in the packed buffers (a multiple of 32, past the last one read) */
    int64_t begin;  /* the first packed key the call reads (a multiple of 32) */
    int64_t lead;   /* keys read before the call's first key (0 to 31) */
    int64_t N;      /* the call's keys */
    float scale;
    int64_t items, tiles;
    int64_t next_item;
} Job;

#ifdef QKV_X86
#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

/* e^x in float32 for x <= 0 (scores minus their running max); 0 below -87. */
TARGET static inline __m512 exp_neg(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), ln2 = _mm512_set1_ps(0.693147180559945309f);
    __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, log2e);
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), ln2); /* |r| <= ln2 / 2 */
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}

static inline float bf16_to_float(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* S[i][0..nk) = (q_i · k_n) · scale for MR rows and the nk keys from n0 (nk: multiple of 32). */
TARGET static void scores(const Job *j, const bf16 *qt, const bf16 *kp, int64_t n0, int64_t nk,
                          float S[MR][KT]) {
    int64_t D = j->D;
    __m512 scale = _mm512_set1_ps(j->scale);
    for (int64_t jb = 0; jb < nk; jb += 32) {
        __m512 acc[MR][2];
        for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        for (int64_t d2 = 0; d2 < D / 2; d2++) {
            const bf16 *at = kp + ((n0 + jb) / 32 * (D / 2) + d2) * 64;
            __m512bh k0 = (__m512bh)_mm512_loadu_si512(at), k1 = (__m512bh)_mm512_loadu_si512(at + 32);
            for (int i = 0; i < MR; i++) {
                int32_t pair;
                memcpy(&pair, qt + i * D + 2 * d2, 4);
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
}

/* O[i] += P[i] · V over nk keys from n0, P given as bfloat16 hi + lo, for 4 rows at a time
   and NV 16-column vectors of the head dim at a time. */
TARGET static inline __attribute__((always_inline)) void pv_block(
        const Job *j, const bf16 *vp, int64_t n0, int64_t nk, const bf16 *Ph, const bf16 *Pl,
        float *O, int i0, int64_t c0, const int NV) {
    int64_t D = j->D;
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < NV; c++) acc[i][c] = _mm512_loadu_ps(O + (i0 + i) * D + c0 + 16 * c);
    for (int64_t n2 = 0; n2 < nk / 2; n2++) {
        const bf16 *at = vp + ((n0 / 2 + n2) * D + c0) * 2;
        __m512bh vv[4];
        for (int c = 0; c < NV; c++) vv[c] = (__m512bh)_mm512_loadu_si512(at + 32 * c);
        for (int i = 0; i < 4; i++) {
            int32_t hi, lo;
            memcpy(&hi, Ph + (i0 + i) * KT + 2 * n2, 4);
            memcpy(&lo, Pl + (i0 + i) * KT + 2 * n2, 4);
            __m512bh ph = (__m512bh)_mm512_set1_epi32(hi), pl = (__m512bh)_mm512_set1_epi32(lo);
            for (int c = 0; c < NV; c++) {
                acc[i][c] = _mm512_dpbf16_ps(acc[i][c], ph, vv[c]);
                acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pl, vv[c]);
            }
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(O + (i0 + i) * D + c0 + 16 * c, acc[i][c]);
}

TARGET static void pv(const Job *j, const bf16 *vp, int64_t n0, int64_t nk, const bf16 *Ph,
                      const bf16 *Pl, float *O) {
    for (int i0 = 0; i0 < MR; i0 += 4) {
        int64_t c0 = 0;
        for (; c0 + 64 <= j->D; c0 += 64) pv_block(j, vp, n0, nk, Ph, Pl, O, i0, c0, 4);
        if (c0 < j->D) pv_block(j, vp, n0, nk, Ph, Pl, O, i0, c0, 2); /* D % 64 == 32 */
    }
}

/* One tile of MR query rows (rows r0.. of the G·R rows of head (b, h); rows past G·R are
   padding) over all keys: the online softmax, then out and lse. */
TARGET static void row_tile(Job *j, int64_t b, int64_t h, int64_t r0) {
    int64_t D = j->D, GR = j->G * j->R, bh = b * j->H + h;
    int64_t lead = j->lead, end = lead + j->N, Np = (end + 31) / 32 * 32;
    const bf16 *kp = j->kp + b * j->ks[0] + h * j->ks[1] + j->begin * D;
    const bf16 *vp = j->vp + b * j->vs[0] + h * j->vs[1] + j->begin * D;
    bf16 qt[MR * MAX_D];
    float O[MR * MAX_D], S[MR][KT], m[MR], l[MR];
    bf16 Ph[MR * KT], Pl[MR * KT];
    int rows = GR - r0 < MR ? (int)(GR - r0) : MR;
    for (int i = 0; i < MR; i++) {
        if (i < rows) {
            int64_t g = (r0 + i) / j->R, r = (r0 + i) % j->R;
            memcpy(qt + i * D, j->q + b * j->qs[0] + h * j->qs[1] + g * j->qs[2] + r * j->qs[3],
                   D * sizeof(bf16));
        } else {
            memset(qt + i * D, 0, D * sizeof(bf16));
        }
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(O, 0, sizeof(float) * MR * D);
    const float *bias = j->bias ? j->bias + b * j->bs[0] + h * j->bs[1] : NULL;
    for (int64_t n0 = 0; n0 < Np; n0 += KT) {
        int64_t nk = Np - n0 < KT ? Np - n0 : KT;
        int64_t first = lead > n0 ? lead - n0 : 0, last = end - n0 < nk ? end - n0 : nk;
        scores(j, qt, kp, n0, nk, S);
        for (int i = 0; i < MR; i++) {
            float *s = S[i];
            if (bias && i < rows) {
                const float *br = bias + (r0 + i) * j->bs[2] + n0 - lead;
                for (int64_t n = first; n < last; n++) s[n] += br[n];
            }
            for (int64_t n = 0; n < first; n++) s[n] = -INFINITY; /* keys outside the call */
            for (int64_t n = last; n < nk; n++) s[n] = -INFINITY;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int64_t n = 0; n < nk; n += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + n));
            float mt = _mm512_reduce_max_ps(mx), mnew = mt > m[i] ? mt : m[i];
            float base = mnew == -INFINITY ? 0.0f : mnew; /* nothing allowed yet: P = 0 */
            float alpha = m[i] == -INFINITY ? 0.0f : expf(m[i] - mnew);
            __m512 sum = _mm512_setzero_ps(), vb = _mm512_set1_ps(base);
            for (int64_t n = 0; n < nk; n += 32) {
                __m512 p0 = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + n), vb));
                __m512 p1 = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + n + 16), vb));
                __m512bh hi = _mm512_cvtne2ps_pbh(p1, p0);
                /* the parts of p that hi leaves out, rounded again */
                __m512i hw = (__m512i)hi;
                __m512 h0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hw)), 16));
                __m512 h1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hw, 1)), 16));
                __m512bh lo = _mm512_cvtne2ps_pbh(_mm512_sub_ps(p1, h1), _mm512_sub_ps(p0, h0));
                _mm512_storeu_si512(Ph + i * KT + n, (__m512i)hi);
                _mm512_storeu_si512(Pl + i * KT + n, (__m512i)lo);
                sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            }
            l[i] = l[i] * alpha + _mm512_reduce_add_ps(sum);
            m[i] = mnew;
            if (alpha != 1.0f) {
                __m512 va = _mm512_set1_ps(alpha);
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_storeu_ps(O + i * D + d, _mm512_mul_ps(_mm512_loadu_ps(O + i * D + d), va));
            }
        }
        pv(j, vp, n0, nk, Ph, Pl, O);
    }
    for (int i = 0; i < rows; i++) {
        int64_t g = (r0 + i) / j->R, r = (r0 + i) % j->R;
        int64_t row = ((bh * j->G + g) * j->R + r);
        float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        for (int64_t d = 0; d < D; d++) j->out[row * D + d] = O[i * D + d] * inv;
        j->lse[row] = l[i] > 0.0f ? m[i] + logf(l[i]) : -INFINITY;
    }
}

/* Each thread takes work items until none is left. */
static void worker(Job *j) {
    for (int64_t it; (it = __atomic_fetch_add(&j->next_item, 1, __ATOMIC_RELAXED)) < j->items;) {
        int64_t bh = it / j->tiles, r0 = (it % j->tiles) * ROWS, GR = j->G * j->R;
        for (int64_t r = r0; r < r0 + ROWS && r < GR; r += MR) row_tile(j, bh / j->H, bh % j->H, r);
    }
}
#endif /* QKV_X86 */

static int cpu_has_bf16(void) {
#ifdef QKV_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

static PyObject *available(PyObject *self, PyObject *args) {
    return PyBool_FromLong(cpu_has_bf16());
}

static PyObject *attend(PyObject *self, PyObject *args) {
    unsigned long long q, kp, vp, bias, out, lse;
    long long qs0, qs1, qs2, qs3, ks0, ks1, vs0, vs1, bs0, bs1, bs2;
    long long B, H, G, R, D, Nt, k0, N;
    double scale;
    int threads;
    if (!PyArg_ParseTuple(args, "(KLLLL)(KLL)(KLL)(KLLL)KK(LLLLL)(LLL)di", &q, &qs0, &qs1, &qs2,
                          &qs3, &kp, &ks0, &ks1, &vp, &vs0, &vs1, &bias, &bs0, &bs1, &bs2, &out,
                          &lse, &B, &H, &G, &R, &D, &Nt, &k0, &N, &scale, &threads))
        return NULL;
    if (!cpu_has_bf16()) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no AVX512-BF16");
        return NULL;
    }
    int64_t begin = k0 / 32 * 32, lead = k0 - begin;
    if (D % 32 != 0 || D > MAX_D || D <= 0 || N <= 0 || R <= 0 || G <= 0 || k0 < 0 ||
        Nt % 32 != 0 || begin + (lead + N + 31) / 32 * 32 > Nt || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "attend: D must be a positive multiple of 32 up to "
                        "256, and the call's keys within the packed buffers");
        return NULL;
    }
#ifdef QKV_X86
    Job j = {0};
    j.q = (const bf16 *)(uintptr_t)q;
    j.kp = (const bf16 *)(uintptr_t)kp;
    j.vp = (const bf16 *)(uintptr_t)vp;
    j.bias = (const float *)(uintptr_t)bias;
    j.out = (float *)(uintptr_t)out;
    j.lse = (float *)(uintptr_t)lse;
    int64_t qs[4] = {qs0, qs1, qs2, qs3}, ks[2] = {ks0, ks1}, vs[2] = {vs0, vs1},
            bs[3] = {bs0, bs1, bs2};
    memcpy(j.qs, qs, sizeof qs);
    memcpy(j.ks, ks, sizeof ks);
    memcpy(j.vs, vs, sizeof vs);
    memcpy(j.bs, bs, sizeof bs);
    j.B = B, j.H = H, j.G = G, j.R = R, j.D = D, j.Nt = Nt;
    j.begin = begin, j.lead = lead, j.N = N;
    j.scale = (float)scale;
    j.tiles = (G * R + ROWS - 1) / ROWS;
    j.items = B * H * j.tiles;
    if (threads > j.items) threads = (int)j.items;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads)
    worker(&j);
    Py_END_ALLOW_THREADS
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"available", available, METH_NOARGS, "Whether this CPU runs the kernel (AVX512-BF16)."},
    {"attend", attend, METH_VARARGS,
     "attend((q, *4 strides), (kp, *2), (vp, *2), (bias|0, *3), out, lse, (B, H, G, R, D), "
     "(Nt, k0, N), scale, threads): one call of the bfloat16 step over keys k0..k0+N-1 of "
     "the packed buffers, into out and lse (float32)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bf16",
                                    "qkv's native bfloat16 attention step (AVX512-BF16).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__bf16(void) { return PyModule_Create(&module); }
