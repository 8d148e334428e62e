/* What the native step's translation units share (_native.c: the Python module and the
   passes; _step512.c, _step256.c and _step128.c: the step for AVX-512, AVX2 and ARM64 NEON,
   from _step.h): the sizes, a call's description, the layouts (_native.c's opening comment)
   and the scalar helpers. */
#ifndef QKV_KERNEL_H
#define QKV_KERNEL_H
#include <stdint.h>
#include <string.h>

#include "../_lanes.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QKV_X86 1
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define QKV_ARM 1
#endif
#if defined(QKV_X86) || defined(QKV_ARM)
#define QKV_STEP 1 /* a step is built for this CPU */
#endif
/* The NEON step has bfloat16 dot products (BFDOT) where GCC builds it (_simd.h says why not
   clang); the CPU is asked at run time whether it has them. */
#if defined(QKV_ARM) && !defined(__clang__)
#define QKV_NEON_BF16 1
#endif

#ifndef MR
#define MR 8 /* query rows per tile (a unit may set 16: _step512_rows16.c) */
#endif
#define KT 256    /* keys per online-softmax step (docs/benchmarks.md: 128 took 1.03× the time) */
#define ROWS 32   /* query rows per work item */
#define MAX_D 576 /* the widest head dim, of Q and K or of V */
#define KB 128    /* keys per backward work item (docs/kernels.md: 64 took 1.03–1.05× the time) */
#define FOLD 512  /* a backward item sums dK and dV over this many live rows, then adds in */
/* How far ahead the ·K and ·V loops ask for the rows they read next (__builtin_prefetch),
   in steps of their loops: 16 dims of a packed key block (2 KB), 16 value rows. A step's
   256 keys and values are 128 KB at D = 64, past the L1 cache: without the requests its
   loads waited on L2 (docs/kernels.md: 8, 16, 24 and 32 measured, flat from 16). */
#define AHEAD 16
/* The floats of scratch a backward work item takes (qkv_key_block): its K and V packed, K's
   rows, and the partial sums of dK and dV of FOLD rows. */
#define KEY_BLOCK_SCRATCH (5 * KB * MAX_D)

/* The vector instruction sets the step is compiled for (by their vectors' bits; SVE's 256
   as 257, apart from AVX2's); float32 runs on any, bfloat16 dot products on AVX-512 with
   AVX512-BF16 and on NEON and SVE with BFDOT. SVE is built where setup.py found the
   compiler takes it (QKV_SVE: _step_sve.c). */
enum { ISA_NONE = 0, ISA_NEON = 128, ISA_AVX2 = 256, ISA_SVE = 257, ISA_AVX512 = 512 };

/* What a call's Q, K, V and dO hold (SRC_*), bf16 and lanemask: ../_lanes.h. */

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
    const void *q, *kp, *vp; /* q as src holds it; kp and the forward's vp: bf16, or float (f32) */
    const float *bias;
    const int32_t *bounds; /* as a Seg's */
    int64_t bnb;
    void *out; /* float32, or (dst) the inputs' half precision, rounded to nearest even */
    float *lse;
    int64_t qs[4], ks[2], vs[3], bs[3], os[4], ls[4]; /* vs[2]: from key to key of vp */
    int64_t B, H, G, R, D, Dv;                        /* Dv: V's head dim (D: Q's and K's) */
    int64_t begin; /* the first packed key the call reads (a multiple of 32) */
    int64_t lead;  /* keys read before the call's first key (0 to 31) */
    int64_t N;     /* the call's keys */
    float scale;
    float cap;           /* > 0: the scaled scores soft-capped, cap · tanh(s / cap); 0: not */
    const float *slopes; /* ALiBi, or NULL: + slopes[h] · (kv_idx - q_idx), h = h_kv · G + g */
    int64_t qpos;        /* q_idx of the call's query row 0 (kv_idx: the key's index in K) */
    int parts;           /* 2: P as bfloat16 hi + lo; 1: hi alone */
    int f32;             /* computed in float32 (else bfloat16 dot products) */
    int src;      /* what Q (the backward: Q, K, V, dO) holds: SRC_F32, SRC_BF16 or SRC_F16 */
    int dst;      /* what out holds: SRC_F32, or SRC_BF16 or SRC_F16 (the forward) */
    int isa;      /* the step that runs it: ISA_AVX512, ISA_AVX2, ISA_SVE or ISA_NEON */
    int blocking; /* its step's blocking: 0, the first, or 1, the second (step_of) */
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
    int64_t D;
    int src; /* what x holds (SRC_*) */
} Pack;

/* A head dim rounded up to 32: the row length of the step's own buffers of rows (Q, dO,
   their float32 copies, the output, dK, dV), zero past the head dim, so that their loops
   run over whole vectors. */
static inline int64_t pad32(int64_t D) { return (D + 31) / 32 * 32; }

/* A backward call: dQ, dK, dV of one call, from the whole rows' lse and Delta. */
typedef struct {
    Job f;            /* q; vp: K itself (read in place, strides vs); sizes */
    const void *dout; /* dO like q */
    int64_t dos[4];
    Pack k, v, kv; /* K and V (B, H, T, D) as they are: score layout, K in bf16's value one */
    int64_t T;
    const float *lse, *delta; /* (B, H, G, R) */
    int64_t ls[4], des[4];
    float *dq; /* (B, H, G, R, D), strides dqs[0..3], D contiguous */
    int64_t dqs[4];
    float *dk, *dv; /* (B, H, N, D): the call's keys, D contiguous */
    int64_t dks[3], dvs[3];
    int64_t blocks; /* key blocks per head */
    /* Where the pass rounds its gradients itself (dq, dk and dv NULL): its dQ, dK and dV
       rows' offsets in a head's float32 sums (Rounded, _native.c), and the strides above
       those of the sums' layout. */
    int64_t at[3];
} BJob;

/* Element i of x (SRC_*) as float32. */
static inline float widened(const void *x, int64_t i, int src) {
    if (src == SRC_F32) return ((const float *)x)[i];
    uint16_t h = ((const uint16_t *)x)[i];
    return src == SRC_F16 ? half_bits(h) : widen(h);
}

/* Keys n0..n0+31 of head (b, h) packed at dst: in float32's layout (f32; any source,
   widened) or bfloat16's. */
static inline void pack32(const Pack *p, int64_t b, int64_t h, int64_t n0, int64_t T, int64_t D,
                          int f32, void *dst) {
    size_t unit = p->src == SRC_F32 ? 4 : 2;
    for (int64_t kk = 0; kk < 32; kk++) {
        int64_t n = n0 + kk, at = b * p->xs[0] + h * p->xs[1] + n * p->xs[2];
        if (f32) {
            const void *xr = (const char *)p->x + at * unit;
            float *kb = dst; /* (D, 32) */
            for (int64_t d = 0; d < D; d++) kb[d * 32 + kk] = n < T ? widened(xr, d, p->src) : 0.0f;
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

/* The element `at` elements past `base` in the dtype the call computes in (its packed
   buffers and row buffers). */
static inline const void *elem(const Job *j, const void *base, int64_t at) {
    return (const char *)base + at * (j->f32 ? 4 : 2);
}

/* The element `at` elements past `base` in what the call's inputs hold. */
static inline const void *raw(const Job *j, const void *base, int64_t at) {
    return (const char *)base + at * (j->src == SRC_F32 ? 4 : 2);
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

/* Where a backward work item puts dQ of the rows that see its keys: added in (add) or
   written, row (g, r) of the head at at + g·gs + r·rs. Written (to a share of the item's
   own), only the rows [span[0], span[1]) — the first and last rows that see its keys, zeros
   in any between that see none — are. */
typedef struct {
    float *at;
    int64_t gs, rs;
    int add;
    int64_t span[2];
} DqOut;

/* Row `row` of the G·R rows (R a query head's) where dq puts it. */
static inline float *dq_row(const DqOut *dq, int64_t R, int64_t row) {
    return dq->at + row / R * dq->gs + row % R * dq->rs;
}

/* The step, per instruction set and blocking (_step.h): a forward work item (ROWS query
   rows of one (b, h), every range of the job) into out and lse; a backward one (KB keys from
   n0 of head (b, h), all rows) into dq (DqOut), dK (KB, pad32(D)) and dV (KB, pad32(Dv)),
   with `scratch` (KEY_BLOCK_SCRATCH floats) for its packed keys; the row dots and the
   packing of half-precision keys, once per instruction set. */
#define STEP_DECLS(S)                                                                              \
    void qkv_forward_item_##S(const Job *j, int64_t it);                                           \
    void qkv_key_block_##S(const BJob *bj, int64_t b, int64_t h, int64_t n0, DqOut *dq, float *dK, \
                           float *dV, void *scratch);
#define ISA_DECLS(S)                                                                               \
    void qkv_row_dots_##S(const void *a, const void *b, int64_t n, int64_t D, int src,             \
                          float *out);                                                             \
    void qkv_pack32_float_##S(const Pack *p, int64_t b, int64_t h, int64_t n0, int64_t T,          \
                              float *dst);                                                         \
    int qkv_finite_##S(const void *x, int64_t n, int src);                                         \
    void qkv_narrow_rows_##S(const float *x, int64_t xs, int64_t n, int64_t D, uint16_t *to,       \
                             int64_t ts, int kind);
#pragma GCC visibility push(hidden)
#ifdef QKV_X86
STEP_DECLS(avx512)
STEP_DECLS(avx512_rows16)
ISA_DECLS(avx512)
STEP_DECLS(avx2)
STEP_DECLS(avx2_rows2)
ISA_DECLS(avx2)
#elif defined(QKV_ARM)
STEP_DECLS(neon)
STEP_DECLS(neon_rows2)
ISA_DECLS(neon)
#ifdef QKV_SVE
STEP_DECLS(sve)
STEP_DECLS(sve_rows2)
ISA_DECLS(sve)
#endif
#endif
#pragma GCC visibility pop
#endif
