/* qkv's native attention step for x86-64 and ARM64 CPUs: the forward and the backward of
   the tiled kernel's fused calls (qkv/kernels/tiled/flash.py), every call of a pass in one
   parallel region (attend_many, backward_many), in float32 (AVX-512F, or AVX2 + FMA + F16C
   where the CPU has no AVX-512; NEON on ARM64), bfloat16 and float16 inputs widened to it as
   they are loaded, or in bfloat16 dot products (AVX512-BF16; BFDOT on ARM64). This file is the
   Python module and the passes; the step itself — what one work item computes — is _step.h,
   compiled per instruction set (_step512.c, _step256.c, _step128.c) over the vectors of _simd.h.

   Forward: softmax(Q Kᵀ · scale + bias) V and its log-sum-exp; the scores, the online
   softmax state and the output accumulate in float32. In float32 both matmuls are float32
   FMAs. In bfloat16, Q, K and V stay bfloat16 and both matmuls run as bfloat16 dot products
   accumulated in float32 (VDPBF16PS, BFDOT); the probabilities enter P·V as two bfloat16 parts,
   hi + lo, so P carries about 16 bits instead of bfloat16's 8: rounding P once to bfloat16
   (what torch's CPU flash kernel does; `parts` = 1 here) breaks qkv's accuracy promise
   (docs/semantics.md) on small sharp problems. Rows with no allowed key give out 0 and lse
   -inf. Work is skipped per 32-key block that no row of an 8-row tile may attend.

   Threads: OpenMP, linked against the libgomp.so.1 torch has already loaded, so the kernel
   runs on torch's own thread pool (threads of a second pool would compete with torch's
   spinning ones for the cores and slow every call).

   The module builds without AVX-512 or AVX2 flags: each function is compiled for its target
   alone and the CPU is asked at run time (`isa()`), so the same build imports everywhere
   and Python falls back to torch's flash kernel where the CPU lacks the instructions.
   QKV_NATIVE_ISA=avx2 in the environment (or `use_isa("avx2")`) runs the kernel as on an
   AVX2-only CPU (float32 on the AVX2 step, no bfloat16 dot products) on a CPU with AVX-512
   too: to test and measure it; QKV_NATIVE_ISA=neon runs the NEON step on a CPU with SVE. Without
   OpenMP (a compiler that lacks it) every pass runs in one thread (`openmp()` says which).

   Layout. q: (B, H, G, R, D) with element strides qs[0..3], D contiguous. In the forward
   K and V come packed once per pass (qkv/kernels/native.py; the backward packs each work
   item's keys itself, from K and V as they are), the 32 keys the score loop takes
   at a time together. bfloat16, in the pairs VDPBF16PS and BFDOT multiply: kp (B, H, Nt/32, D/2,
   32, 2) and vp (B, H, Nt/2, D_v, 2), zero past the last key; float32: kp (B, H, Nt/32, D, 32),
   zero past the last key, and vp V itself (D contiguous, rows vs[2] apart, never read past
   a call's keys). Strides ks/vs[0..1] over B and H; a call reads keys k0..k0+N-1 of
   them. bias: float32, (B|1, H|1, G·R, N) with strides bs[0..2] (0 where broadcast), N
   contiguous, or NULL; bounds (instead of a bias, masks whose every row sees one interval
   of keys): int32 (B|1, R, 2), each query position's keys [lo, hi) counted from k0,
   stride bnb over B (0 where broadcast), or NULL; out: float32, or bfloat16 or float16
   (each value rounded once, to nearest even, as torch rounds float32), (B, H, G, R, D) with
   strides os[0..3], D_v contiguous; lse: float32 (B, H, G, R) with strides ls[0..3]. D
   (Q's and K's head dim) and D_v (V's) are any sizes up to 576 (bfloat16: even, for the
   pairs the backward multiplies V in too); the step's own row buffers are padded to 32 and V is
   read under a mask where a row ends inside a vector. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_kernel.h"
#include "../_cpu.h"
#include "../_fields.h"

/* Threads: OpenMP where the compiler has it; without it the passes run in one thread (the
   parallel regions below are then plain blocks, the lock a no-op). */
#ifdef _OPENMP
#include <omp.h>
typedef omp_lock_t qkv_lock;
#define LOCK_INIT(l) omp_init_lock(l)
#define LOCK(l) omp_set_lock(l)
#define UNLOCK(l) omp_unset_lock(l)
#define LOCK_FREE(l) omp_destroy_lock(l)
#else
typedef int qkv_lock;
#define LOCK_INIT(l) ((void)(l))
#define LOCK(l) ((void)(l))
#define UNLOCK(l) ((void)(l))
#define LOCK_FREE(l) ((void)(l))
#endif

#ifdef QKV_STEP
/* The entry points of one compiled step (_step.h: a unit per instruction set and register
   blocking). */
typedef struct {
    void (*forward_item)(const Job *, int64_t);
    void (*key_block)(const BJob *, int64_t, int64_t, int64_t, DqOut *, float *, float *, void *);
    void (*row_dots)(const void *, const void *, int64_t, int64_t, int, float *);
    void (*pack32_float)(const Pack *, int64_t, int64_t, int64_t, int64_t, float *);
    int (*finite)(const void *, int64_t, int);
    void (*narrow_rows)(const float *, int64_t, int64_t, int64_t, uint16_t *, int64_t, int);
} StepFns;

/* The entry points of the unit for instruction set ISA (a name's suffix) and blocking
   BLOCK (_rows2 or _rows16, or empty); its row dots and packing are the same in both. */
#define STEP_FNS(ISA, BLOCK)                                                                       \
    ((StepFns){qkv_forward_item_##ISA##BLOCK, qkv_key_block_##ISA##BLOCK, qkv_row_dots_##ISA,      \
               qkv_pack32_float_##ISA, qkv_finite_##ISA, qkv_narrow_rows_##ISA})

/* The step of instruction set isa (not ISA_NONE) in its first blocking (0) or its second
   (1): AVX-512 tiles of 8 query rows or 16; AVX2, NEON and SVE 3 rows in registers or 2. */
static StepFns step_of(int isa, int blocking) {
#ifdef QKV_X86
    if (isa == ISA_AVX2) return blocking ? STEP_FNS(avx2, _rows2) : STEP_FNS(avx2, );
    return blocking ? STEP_FNS(avx512, _rows16) : STEP_FNS(avx512, );
#else
#ifdef QKV_SVE
    if (isa == ISA_SVE) return blocking ? STEP_FNS(sve, _rows2) : STEP_FNS(sve, );
#endif
    return blocking ? STEP_FNS(neon, _rows2) : STEP_FNS(neon, );
#endif
}
#undef STEP_FNS
#endif

/* ---- the backward: dQ, dK, dV of one call, from the whole rows' lse and Delta ----------

   A work item is one key block of one head, over all rows (_step.h computes it): its dK
   and dV are its own; its share of dQ is added to dq in key-block order (commit), so dQ's
   bits do not depend on which thread ran which block, nor on how many threads ran. Where
   the heads are many enough to keep every thread busy (HEADS_PER_THREAD), a work item is a
   whole head instead (head_worker): its thread runs the head's key blocks in the same order,
   adding dQ into dq in place and each dK and dV share as soon as it is made, so the same
   bits, without the shares' round trip through memory. */

/* heads (B·H) per thread from which a backward pass's work items are whole heads: a thread
   then waits at most for one head of the four or more it runs, where the shares' traffic
   took 6–9% of a causal backward's time (docs/kernels.md) */
#define HEADS_PER_THREAD 4

/* A backward pass's gradients rounded by the pass itself to the inputs' half precision
   (dst), instead of summed into float32 tensors that torch then rounds: each head's dQ, dK
   and dV summed in float32 in a buffer of the head's own (`sums`: dQ (G, Tq, pad32(D)), dK
   (Tk, pad32(D)), dV (Tk, pad32(Dv)), zero-filled), each call's rows at its offsets
   (BJob.at), and rounded into dq, dk and dv as the head's last share is added: the same
   sums in the same order, each rounded once as torch's .to() would, with no float32
   gradients of the whole pass in memory and no pass over them after. */
typedef struct {
    uint16_t *dq, *dk, *dv; /* (B, H, G, Tq, D), (B, H, Tk, D), (B, H, Tk, Dv), D contiguous */
    int64_t dqs[4], dks[3], dvs[3];
    int64_t B, H, G, Tq, Tk, D, Dv;
    int dst; /* SRC_BF16 or SRC_F16 */
    int isa; /* the step whose vectors round them */
} Rounded;

/* The floats of one head's sums. */
static int64_t head_floats(const Rounded *o) {
    return (o->G * o->Tq + o->Tk) * pad32(o->D) + o->Tk * pad32(o->Dv);
}

#ifdef QKV_STEP
/* Row 0 of call bj's float32 dQ (x = 0), dK (1) or dV (2) of head (b, h): in its own
   tensors, or in the head's sums where the pass rounds them (Rounded). */
static float *grads_of(const BJob *bj, int x, int64_t b, int64_t h, float *sums) {
    if (sums) return sums + bj->at[x];
    if (x == 0) return bj->dq + b * bj->dqs[0] + h * bj->dqs[1];
    if (x == 1) return bj->dk + b * bj->dks[0] + h * bj->dks[1];
    return bj->dv + b * bj->dvs[0] + h * bj->dvs[1];
}

/* An item's shares (dK and dV of its key block; dQ of its rows, unless it added them in
   itself) added to the call's dk, dv and dq (or to the head's sums: grads_of). */
static void add_share(const BJob *bj, int64_t b, int64_t h, int64_t n0, const DqOut *dq,
                      const float *dKa, const float *dVa, float *sums) {
    const Job *j = &bj->f;
    int64_t D = j->D, Dv = j->Dv, Dp = pad32(D), Dvp = pad32(Dv);
    int64_t lead = j->lead, end = lead + j->N, Np = (end + 31) / 32 * 32;
    int64_t nk = Np - n0 < KB ? Np - n0 : KB;
    int64_t first = lead > n0 ? lead - n0 : 0, last = end - n0 < nk ? end - n0 : nk;
    float *dq0 = grads_of(bj, 0, b, h, sums), *dk0 = grads_of(bj, 1, b, h, sums);
    float *dv0 = grads_of(bj, 2, b, h, sums);
    for (int64_t row = dq->span[0]; !dq->add && row < dq->span[1]; row++) { /* as written */
        float *dqr = dq0 + row / j->R * bj->dqs[2] + row % j->R * bj->dqs[3];
        const float *share = dq_row(dq, j->R, row);
        for (int64_t d = 0; d < D; d++) dqr[d] += share[d];
    }
    for (int64_t n = first; n < last; n++) { /* the call's key n - lead */
        float *dk = dk0 + (n0 + n - lead) * bj->dks[2], *dv = dv0 + (n0 + n - lead) * bj->dvs[2];
        for (int64_t d = 0; d < D; d++) dk[d] += dKa[n * Dp + d];
        for (int64_t d = 0; d < Dv; d++) dv[d] += dVa[n * Dvp + d];
    }
}

/* The pass's outputs all zero: a pass with no work item (no call, or none with a key). */
static void zero_grads(const Rounded *o) {
    for (int64_t b = 0; b < o->B; b++)
        for (int64_t h = 0; h < o->H; h++) {
            for (int64_t g = 0; g < o->G; g++)
                for (int64_t t = 0; t < o->Tq; t++)
                    memset(o->dq + b * o->dqs[0] + h * o->dqs[1] + g * o->dqs[2] + t * o->dqs[3], 0,
                           (size_t)o->D * 2);
            for (int64_t t = 0; t < o->Tk; t++) {
                memset(o->dk + b * o->dks[0] + h * o->dks[1] + t * o->dks[2], 0, (size_t)o->D * 2);
                memset(o->dv + b * o->dvs[0] + h * o->dvs[1] + t * o->dvs[2], 0, (size_t)o->Dv * 2);
            }
        }
}

/* Head bh's sums rounded into the pass's outputs (Rounded). */
static void round_head(const Rounded *o, int64_t H, int64_t bh, const float *sums) {
    const StepFns f = step_of(o->isa, 0);
    const int64_t b = bh / H, h = bh % H, Dp = pad32(o->D), Dvp = pad32(o->Dv);
    const float *dk = sums + o->G * o->Tq * Dp, *dv = dk + o->Tk * Dp;
    for (int64_t g = 0; g < o->G; g++)
        f.narrow_rows(sums + g * o->Tq * Dp, Dp, o->Tq, o->D,
                      o->dq + b * o->dqs[0] + h * o->dqs[1] + g * o->dqs[2], o->dqs[3], o->dst);
    f.narrow_rows(dk, Dp, o->Tk, o->D, o->dk + b * o->dks[0] + h * o->dks[1], o->dks[2], o->dst);
    f.narrow_rows(dv, Dvp, o->Tk, o->Dv, o->dv + b * o->dvs[0] + h * o->dvs[1], o->dvs[2], o->dst);
}

/* A backward pass: every call's work items (one key block of one (b, h) each) dealt from
   one counter in one parallel region. An item computes its shares into a buffer of its own;
   the shares are added to dq, dk and dv in one fixed order per (b, h) — call by call, key
   block by key block — by whichever thread holds the lock when the share before it is in:
   no race where two calls' keys overlap, no waiting for a slower thread's item, and the
   same bits whatever the threads did. */
typedef struct {
    float *mem; /* dK and dV (KB·pad32(D), KB·pad32(D_v)), then the dQ share (dq.at) */
    int64_t call, n0;
    DqOut dq;
} Share;

typedef struct {
    BJob *calls;
    int64_t n, B, H;
    int64_t *start;     /* the calls' first items (n + 1) */
    int64_t *chain0;    /* each call's first place in a (b, h)'s order */
    int64_t chain;      /* places in each (b, h)'s order: every call's key blocks */
    Share *pending;     /* (B·H) × chain; mem NULL until the share is in */
    int64_t *committed; /* per (b, h): the places added so far */
    qkv_lock lock;
    int64_t next, done;
    const Rounded *rounded; /* NULL: the calls' gradients go to their float32 tensors */
    float **sums;           /* per (b, h) where rounded: its sums from its first share on */
    int nomem;              /* a head's sums found no memory */
} Pass;

/* The floats of an item's dK and dV shares (KB·pad32(D), KB·pad32(D_v)): each row on a
   64-byte line, and the dQ share (if it has one) after them. */
static int64_t kv_floats(const BJob *bj) { return KB * pad32(bj->f.D) + KB * pad32(bj->f.Dv); }

/* Where the pass rounds its gradients, a head's sums are made as its first share comes in,
   and rounded (outside the lock: no other share of the head is left) and freed by the
   thread that adds its last. */
static void commit(Pass *ps, int64_t bh, int64_t place, Share share) {
    float *ended = NULL;
    LOCK(&ps->lock);
    ps->pending[bh * ps->chain + place] = share;
    for (Share *s; ps->committed[bh] < ps->chain &&
                   (s = &ps->pending[bh * ps->chain + ps->committed[bh]])->mem;) {
        const BJob *bj = &ps->calls[s->call];
        if (ps->rounded && ps->committed[bh] == 0 &&
            !(ps->sums[bh] = calloc((size_t)head_floats(ps->rounded), sizeof(float))))
            ps->nomem = 1;
        if (!ps->rounded || ps->sums[bh])
            add_share(bj, bh / ps->H, bh % ps->H, s->n0, &s->dq, s->mem,
                      s->mem + KB * pad32(bj->f.D), ps->rounded ? ps->sums[bh] : NULL);
        free(s->mem);
        s->mem = NULL;
        if (++ps->committed[bh] == ps->chain && ps->rounded) ended = ps->sums[bh];
    }
    UNLOCK(&ps->lock);
    if (ended) {
        round_head(ps->rounded, ps->H, bh, ended);
        free(ended);
        ps->sums[bh] = NULL;
    }
}

/* Key block kb of head bh of call bj computed into dq and its shares of dK and dV at mem. */
static void key_block(const Pass *ps, const BJob *bj, int64_t bh, int64_t kb, DqOut *dq, float *mem,
                      void *scratch) {
    step_of(bj->f.isa, bj->f.blocking)
        .key_block(bj, bh / ps->H, bh % ps->H, kb * KB, dq, mem, mem + KB * pad32(bj->f.D),
                   scratch);
}

/* A work item per key block of a head, each share committed in the head's order: its dQ
   share too, written after its dK and dV (G·R rows of D). */
static void backward_worker(Pass *ps) {
    int64_t items = ps->start[ps->n], c = 0;
    /* this thread's packed keys; it and each item's shares on 64-byte lines, so that no
       vector load or store of a row splits a cache line (malloc's 16 bytes into a line made
       half of AVX2's do: docs/kernels.md) */
    void *scratch = aligned_alloc(64, KEY_BLOCK_SCRATCH * sizeof(float));
    for (int64_t it; (it = __atomic_fetch_add(&ps->next, 1, __ATOMIC_RELAXED)) < items;) {
        while (it >= ps->start[c + 1]) c++; /* a thread's items only grow */
        BJob *bj = &ps->calls[c];
        int64_t local = it - ps->start[c], bh = local / bj->blocks, kb = local % bj->blocks;
        int64_t D = bj->f.D, floats = kv_floats(bj) + bj->f.G * bj->f.R * D;
        float *mem = aligned_alloc(64, ((size_t)floats * sizeof(float) + 63) / 64 * 64);
        if (!mem || !scratch) { /* (its item is not done: the caller raises) */
            free(mem);
            break;
        }
        Share share = {mem, c, kb * KB, {mem + kv_floats(bj), bj->f.R * D, D, 0, {0, 0}}};
        key_block(ps, bj, bh, kb, &share.dq, mem, scratch);
        commit(ps, bh, ps->chain0[c] + kb, share);
        __atomic_fetch_add(&ps->done, 1, __ATOMIC_RELAXED);
    }
    free(scratch);
}

/* A work item per head: its key blocks in commit's order (call by call, key block by key
   block), each adding its dQ into dq as it goes and its shares of dK and dV, from one
   buffer the thread reuses, as soon as it is done. */
static void head_worker(Pass *ps) {
    void *scratch = aligned_alloc(64, KEY_BLOCK_SCRATCH * sizeof(float));
    float *mem = NULL;
    int64_t held = 0; /* mem's floats */
    const int64_t heads = ps->B * ps->H;
    /* where the pass rounds its gradients: this thread's sums, one head's at a time */
    size_t sized = ps->rounded ? (size_t)head_floats(ps->rounded) * sizeof(float) : 0;
    float *sums = ps->rounded ? malloc(sized) : NULL;
    for (int64_t bh; scratch && (!ps->rounded || sums) &&
                     (bh = __atomic_fetch_add(&ps->next, 1, __ATOMIC_RELAXED)) < heads;) {
        if (sums) memset(sums, 0, sized);
        for (int64_t c = 0; c < ps->n; c++) {
            const BJob *bj = &ps->calls[c];
            if (kv_floats(bj) > held) {
                free(mem);
                mem = aligned_alloc(64, (size_t)kv_floats(bj) * sizeof(float));
                held = mem ? kv_floats(bj) : 0;
            }
            float *dq = grads_of(bj, 0, bh / ps->H, bh % ps->H, sums);
            for (int64_t kb = 0; mem && kb < bj->blocks; kb++) {
                DqOut out = {dq, bj->dqs[2], bj->dqs[3], 1, {0, 0}};
                key_block(ps, bj, bh, kb, &out, mem, scratch);
                add_share(bj, bh / ps->H, bh % ps->H, kb * KB, &out, mem, mem + KB * pad32(bj->f.D),
                          sums);
                __atomic_fetch_add(&ps->done, 1, __ATOMIC_RELAXED); /* (an item: a key block) */
            }
        }
        if (sums && mem) round_head(ps->rounded, ps->H, bh, sums);
    }
    free(sums);
    free(mem);
    free(scratch);
}
#endif /* QKV_STEP */

/* Packs block `it` of B·H·(Nt/32): 32 keys of one head, by pack32, or, in float32's layout
   (f32), by the step of isa where one runs here (its vector loads, which widen half
   precision, and a transposition in L1: pack32 goes value by value). */
static void pack_block(const Pack *p, int64_t it, int64_t H, int64_t T, int64_t Nt, int f32,
                       int isa) {
    int64_t bh = it / (Nt / 32), nb = it % (Nt / 32);
    void *dst = (char *)p->dst + it * 32 * p->D * (f32 ? 4 : 2);
#ifdef QKV_STEP
    if (f32 && isa != ISA_NONE) {
        step_of(isa, 0).pack32_float(p, bh / H, bh % H, nb * 32, T, dst);
        return;
    }
#endif
    pack32(p, bh / H, bh % H, nb * 32, T, p->D, f32, dst);
}

/* Every pack of a pass in one parallel region. */
static void pack_all(const Pack *packs, int64_t n, int64_t B, int64_t H, int64_t T, int64_t Nt,
                     int threads, int f32, int isa) {
    int64_t blocks = B * H * (Nt / 32);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
    for (int64_t it = 0; it < n * blocks; it++)
        pack_block(&packs[it / blocks], it % blocks, H, T, Nt, f32, isa);
}

/* What a call's inputs hold, named by torch's dtype ("float32", "bfloat16", "float16"), into
   *src; 0 with a Python error set if it is none of them, or if bfloat16's dot products (not
   f32) are asked of other inputs. */
static int source_of(const char *name, int f32, const char *what, int *src) {
    *src = !strcmp(name, "float32")    ? SRC_F32
           : !strcmp(name, "bfloat16") ? SRC_BF16
           : !strcmp(name, "float16")  ? SRC_F16
                                       : -1;
    if (*src < 0 || (!f32 && *src != SRC_BF16)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: source \"float32\", \"bfloat16\" or \"float16\" (float32 steps "
                     "widen half precision; bfloat16 steps take bfloat16), not \"%s\"",
                     what, name);
        return 0;
    }
    return 1;
}

static int cpu_isa(int f32);

static PyObject *pack_py(PyObject *self, PyObject *args, PyObject *kwargs) {
    PyObject *list;
    long long B, H, T, Nt;
    int threads, f32, src;
    const char *source;
    static char *names[] = {"packs", "sizes", "threads", "float32", "source", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$O!(LLLL)ips", names, &PyList_Type, &list, &B,
                                     &H, &T, &Nt, &threads, &f32, &source) ||
        !source_of(source, f32, "pack", &src))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (Nt % 32 != 0 || Nt < T || threads < 1 || n > 8) {
        PyErr_SetString(PyExc_ValueError, "pack: Nt a multiple of 32 covering T, at most 8 packs");
        return NULL;
    }
    Pack packs[8];
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long x, dst;
        long long xs0, xs1, xs2, D;
        int values;
        static char *fields[] = {"x", "dst", "values", "D", NULL};
        if (!parse_fields(PyList_GET_ITEM(list, i), "pack", "$(KLLL)KpL", fields, &x, &xs0, &xs1,
                          &xs2, &dst, &values, &D))
            return NULL;
        values = values && !f32;
        if (D <= 0 || D > MAX_D || (!f32 && D % 2 != 0)) {
            PyErr_SetString(PyExc_ValueError, "pack: D from 1 to 576, even in bfloat16");
            return NULL;
        }
        packs[i] = (Pack){
            (const void *)(uintptr_t)x, {xs0, xs1, xs2}, (void *)(uintptr_t)dst, values, D, src};
    }
    const int isa = cpu_isa(1);
    Py_BEGIN_ALLOW_THREADS pack_all(packs, n, B, H, T, Nt, threads, f32, isa);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* Whether the n values at x (SRC_*) are all finite (no exponent all ones): one thread, no
   parallel region, so that on a busy machine no descheduled thread holds the check up;
   chunk by chunk, stopping at the first chunk that holds NaN or inf. On the step's vectors
   where the CPU runs one (the loop below runs SSE2's 4 lanes: its cost, docs/benchmarks.md,
   "measurements behind code choices"). */
static int all_finite(const void *x, int64_t n, int src) {
#ifdef QKV_STEP
    const int isa = cpu_isa(1);
    if (isa != ISA_NONE) return step_of(isa, 0).finite(x, n, src);
#endif
    const uint16_t ones = src == SRC_F16 ? 0x7c00u : 0x7f80u; /* a half's exponent bits */
    const int64_t chunk = 1 << 14;
    for (int64_t i0 = 0; i0 < n; i0 += chunk) {
        int64_t i1 = n - i0 < chunk ? n : i0 + chunk;
        unsigned bad = 0;
        if (src == SRC_F32) {
            const uint32_t *u = (const uint32_t *)x;
            for (int64_t i = i0; i < i1; i++) bad |= (u[i] & 0x7f800000u) == 0x7f800000u;
        } else {
            const uint16_t *u = (const uint16_t *)x;
            for (int64_t i = i0; i < i1; i++) bad |= (u[i] & ones) == ones;
        }
        if (bad) return 0;
    }
    return 1;
}

static PyObject *finite_py(PyObject *self, PyObject *args, PyObject *kwargs) {
    unsigned long long x;
    long long n;
    int src, found;
    const char *source;
    static char *names[] = {"x", "n", "source", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$KLs", names, &x, &n, &source) ||
        !source_of(source, 1, "finite", &src))
        return NULL;
    Py_BEGIN_ALLOW_THREADS found = all_finite((const void *)(uintptr_t)x, n, src);
    Py_END_ALLOW_THREADS return PyBool_FromLong(found);
}

/* The instruction set this CPU runs the step on in float32 (f32; half-precision inputs
   widened) or in bfloat16 dot products: AVX-512 (F/BW/DQ/VL; bfloat16 needs AVX512-BF16
   too), else, for float32, AVX2 + FMA + F16C; on ARM64, SVE where its vectors are 256 bits
   and the SVE step is built, else NEON (every ARM64 CPU; bfloat16 needs BFDOT, SVE's or
   NEON's); ISA_NONE if none. `pinned` (use_isa; QKV_NATIVE_ISA at the first call) runs
   the CPU as one without the wider set would: PIN_AVX2, float32 on AVX2 and no bfloat16 dot
   products; PIN_NEON, the NEON step where the CPU has SVE. */
static int pinned = PIN_NONE;

static int cpu_isa(int f32) {
#ifdef QKV_X86
    int avx512 = qkv_cpu_avx512(), avx2 = qkv_cpu_avx2();
    if (!f32) return qkv_cpu_bf16() && pinned != PIN_AVX2 ? ISA_AVX512 : ISA_NONE;
    if (avx2 && (pinned == PIN_AVX2 || !avx512)) return ISA_AVX2;
    return avx512 ? ISA_AVX512 : ISA_NONE;
#elif defined(QKV_ARM)
#ifdef QKV_SVE
    if (pinned != PIN_NEON && qkv_cpu_sve256()) {
        if (f32) return ISA_SVE;
#ifdef QKV_NEON_BF16
        if (qkv_cpu_sve_bf16()) return ISA_SVE;
#endif
    }
#endif
#ifdef QKV_NEON_BF16
    return f32 || qkv_cpu_bf16() ? ISA_NEON : ISA_NONE;
#else
    return f32 ? ISA_NEON : ISA_NONE;
#endif
#else
    return ISA_NONE;
#endif
}

static const char *isa_name(int isa) {
    return isa == ISA_AVX512 ? "avx512"
           : isa == ISA_AVX2 ? "avx2"
           : isa == ISA_SVE  ? "sve"
           : isa == ISA_NEON ? "neon"
                             : "";
}

static PyObject *available(PyObject *self, PyObject *args) {
    int f32;
    if (!PyArg_ParseTuple(args, "p", &f32)) return NULL;
    return PyBool_FromLong(cpu_isa(f32) != ISA_NONE);
}

static PyObject *isa_py(PyObject *self, PyObject *args) {
    int f32;
    if (!PyArg_ParseTuple(args, "p", &f32)) return NULL;
    return PyUnicode_FromString(isa_name(cpu_isa(f32)));
}

/* rowsum(a ∘ b) of n contiguous rows of D values (SRC_*) into out, float32, on the step's
   vectors: one thread, as all_finite (the backward's Delta; a few milliseconds). */
static PyObject *row_dots(PyObject *self, PyObject *args, PyObject *kwargs) {
    unsigned long long a, b, out;
    long long n, D;
    int src;
    const char *source;
    static char *names[] = {"a", "b", "out", "n", "D", "source", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$KKKLLs", names, &a, &b, &out, &n, &D,
                                     &source) ||
        !source_of(source, 1, "row_dots", &src))
        return NULL;
    if (n < 0 || D <= 0) {
        PyErr_SetString(PyExc_ValueError, "row_dots: n >= 0 rows of D > 0 values");
        return NULL;
    }
#ifdef QKV_STEP
    const int isa = cpu_isa(1);
    if (isa == ISA_NONE) {
        PyErr_SetString(PyExc_RuntimeError, "row_dots: this CPU runs no step");
        return NULL;
    }
    const void *x = (const void *)(uintptr_t)a, *y = (const void *)(uintptr_t)b;
    float *o = (float *)(uintptr_t)out;
    Py_BEGIN_ALLOW_THREADS step_of(isa, 3).row_dots(x, y, n, D, src, o);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_RuntimeError, "row_dots: no step is built for this CPU");
    return NULL;
#endif
}

/* Whether the module was built with OpenMP (else every pass runs in one thread). */
static PyObject *openmp(PyObject *self, PyObject *args) {
#ifdef _OPENMP
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

/* Pins float32 to AVX2 ("avx2") or lets the CPU choose (""); returns the pin before. */
static PyObject *use_isa(PyObject *self, PyObject *args) {
    int pin = pin_named(args);
    if (pin < 0) return NULL;
    PyObject *before = PyUnicode_FromString(pin_name(pinned));
    pinned = pin;
    return before;
}

/* The steps' blocking (use_blocking, step_of) forward [0] and backward [1]: 0, the first,
   or 1, the second. */
static int step_blocking[2] = {0, 0};

/* Sets the forward's blocking, or the backward's (0 or 1); returns the setting before. */
static PyObject *use_blocking(PyObject *self, PyObject *args) {
    int blocking, backward = 0;
    if (!PyArg_ParseTuple(args, "i|p", &blocking, &backward)) return NULL;
    if (blocking != 0 && blocking != 1) {
        PyErr_Format(PyExc_ValueError, "use_blocking: 0 or 1, not %d", blocking);
        return NULL;
    }
    int before = step_blocking[backward];
    step_blocking[backward] = blocking;
    return PyLong_FromLong(before);
}

/* Checks one call's sizes and fills them into j; 0 with a Python error set if they do not
   fit the kernel or the CPU lacks the instructions. */
static int call_sizes(Job *j, const char *name, long long B, long long H, long long G, long long R,
                      long long D, long long Dv, double scale, double cap, int f32, int threads) {
    j->isa = cpu_isa(f32);
    j->blocking = step_blocking[0]; /* the backward's: set by its caller */
    if (j->isa == ISA_NONE) {
        PyErr_SetString(PyExc_RuntimeError,
                        f32 ? "this CPU runs no native step (AVX-512, AVX2 + FMA or NEON)"
                            : "this CPU has no bfloat16 dot products (AVX512-BF16 or BFDOT)");
        return 0;
    }
    if (D > MAX_D || D <= 0 || Dv > MAX_D || Dv <= 0 || (!f32 && (D % 2 || Dv % 2)) || R <= 0 ||
        G <= 0 || threads < 1) {
        PyErr_Format(PyExc_ValueError, "%s: D and D_v from 1 to 576 (bfloat16: even)", name);
        return 0;
    }
    j->B = B, j->H = H, j->G = G, j->R = R, j->D = D, j->Dv = Dv;
    if (!(cap >= 0.0 && cap < INFINITY)) {
        PyErr_Format(PyExc_ValueError, "%s: the soft-cap must be finite and > 0 (0: none)", name);
        return 0;
    }
    j->scale = (float)scale;
    j->cap = (float)cap;
    j->f32 = f32;
    return 1;
}

/* Keys k0..k0+N-1 as a range of packed buffers of Nt keys; 0 with a Python error set if
   they do not lie within them. */
static int key_range(Seg *s, const char *name, long long Nt, long long k0, long long N) {
    int64_t begin = k0 / 32 * 32, lead = k0 - begin;
    if (N <= 0 || k0 < 0 || Nt % 32 != 0 || begin + (lead + N + 31) / 32 * 32 > Nt) {
        PyErr_Format(PyExc_ValueError,
                     "%s: the call's keys must lie within the packed "
                     "buffers",
                     name);
        return 0;
    }
    s->begin = begin, s->lead = lead, s->N = N;
    return 1;
}

/* One call's arguments (attend's, less the thread count) into j; 0 with a Python error
   set if they do not parse or fit. */
static int parse_call(Job *j, PyObject *args, int threads) {
    unsigned long long q, kp, vp, out, lse;
    long long qs0, qs1, qs2, qs3, ks0, ks1, vs0, vs1, vs2, os0, os1, os2, os3, ls0, ls1, ls2, ls3;
    long long B, H, G, R, D, Dv, Nt;
    double scale, cap;
    unsigned long long slopes;
    long long qpos;
    int parts, f32, src, dst;
    const char *source, *out_dtype;
    PyObject *ranges;
    memset(j, 0, sizeof *j);
    static char *names[] = {"q",       "k",      "v",         "ranges",  "out",   "lse",
                            "sizes",   "Nt",     "scale",     "softcap", "alibi", "p_parts",
                            "float32", "source", "out_dtype", NULL};
    if (!parse_fields(args, "attend", "$(KLLLL)(KLL)(KLLL)O!(KLLLL)(KLLLL)(LLLLLL)Ldd(KL)ipss",
                      names, &q, &qs0, &qs1, &qs2, &qs3, &kp, &ks0, &ks1, &vp, &vs0, &vs1, &vs2,
                      &PyList_Type, &ranges, &out, &os0, &os1, &os2, &os3, &lse, &ls0, &ls1, &ls2,
                      &ls3, &B, &H, &G, &R, &D, &Dv, &Nt, &scale, &cap, &slopes, &qpos, &parts,
                      &f32, &source, &out_dtype) ||
        !source_of(source, f32, "attend", &src) || !source_of(out_dtype, 1, "attend: out", &dst))
        return 0;
    if (dst != SRC_F32 && dst != src) {
        PyErr_SetString(PyExc_ValueError, "attend: out is float32 or the inputs' dtype");
        return 0;
    }
    if (!call_sizes(j, "attend", B, H, G, R, D, Dv, scale, cap, f32, threads)) return 0;
    j->src = src, j->dst = dst;
    j->slopes = (const float *)(uintptr_t)slopes, j->qpos = qpos;
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
        static char *fields[] = {"k0", "N", "bias", "bounds", NULL};
        if (!parse_fields(PyList_GET_ITEM(ranges, s), "attend: a range", "$LL(KLLL)(KL)", fields,
                          &k0, &N, &bias, &bs0, &bs1, &bs2, &bounds, &bnb) ||
            !key_range(&segs[s], "attend", Nt, k0, N))
            return 0;
        segs[s].bias = (const float *)(uintptr_t)bias;
        segs[s].bounds = (const int32_t *)(uintptr_t)bounds, segs[s].bnb = bnb;
        segs[s].bs[0] = bs0, segs[s].bs[1] = bs1, segs[s].bs[2] = bs2;
    }
#ifdef QKV_STEP
    j->q = (const void *)(uintptr_t)q;
    j->kp = (const void *)(uintptr_t)kp;
    j->vp = (const void *)(uintptr_t)vp;
    j->out = (void *)(uintptr_t)out;
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
        if (!parse_call(&jobs[c], one, threads)) failed = Py_None;
        start[c + 1] = start[c] + jobs[c].items;
    }
    if (failed) {
        for (Py_ssize_t c = 0; c < n; c++) free((void *)jobs[c].segs);
        free(jobs), free(start);
        return NULL;
    }
#ifdef QKV_STEP
    int64_t next = 0, items = start[n];
    if (threads > items) threads = items > 0 ? (int)items : 1;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads)
    {
        Py_ssize_t c = 0; /* each thread's items only grow: its call index only moves on */
        for (int64_t it; (it = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED)) < items;) {
            while (it >= start[c + 1]) c++;
            step_of(jobs[c].isa, jobs[c].blocking).forward_item(&jobs[c], it - start[c]);
        }
    }
    Py_END_ALLOW_THREADS
#endif
        for (Py_ssize_t c = 0; c < n; c++) free((void *)jobs[c].segs);
    free(jobs), free(start);
    Py_RETURN_NONE;
}

/* A list of calls (each a dict of named fields) and a thread count, run. */
static PyObject *attend_many(PyObject *self, PyObject *args, PyObject *kwargs) {
    PyObject *list;
    int threads;
    static char *names[] = {"calls", "threads", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$O!i", names, &PyList_Type, &list, &threads))
        return NULL;
    return run_calls(list, threads);
}

/* One backward call's arguments (backward's, less the thread count) into bj, its
   gradients' rows in a head's sums where the pass rounds them (o); 0 with a Python error
   set if they do not parse or fit. */
static int parse_backward(BJob *bj, PyObject *args, int threads, const Rounded *o) {
    unsigned long long q, dout, k, v, bias, bounds, lse, delta, dq, dk, dv;
    long long qs[4], dos[4], kst[3], vst[3], bs[3], bnb, ls[4], des[4], dqs[4], dks[3], dvs[3];
    long long B, H, G, R, D, Dv, T, k0, N, q0;
    double scale, cap;
    unsigned long long slopes;
    long long qpos;
    int f32, src;
    const char *source;
    static char *names[] = {"q",     "dout",    "k",     "v",       "bias",   "bounds", "lse",
                            "delta", "dq",      "dk",    "dv",      "sizes",  "keys",   "q0",
                            "scale", "softcap", "alibi", "float32", "source", NULL};
    if (!parse_fields(args, "backward",
                      "$(KLLLL)(KLLLL)(KLLL)(KLLL)(KLLL)(KL)(KLLLL)(KLLLL)(KLLLL)(KLLL)"
                      "(KLLL)(LLLLLL)(LLL)Ldd(KL)ps",
                      names, &q, &qs[0], &qs[1], &qs[2], &qs[3], &dout, &dos[0], &dos[1], &dos[2],
                      &dos[3], &k, &kst[0], &kst[1], &kst[2], &v, &vst[0], &vst[1], &vst[2], &bias,
                      &bs[0], &bs[1], &bs[2], &bounds, &bnb, &lse, &ls[0], &ls[1], &ls[2], &ls[3],
                      &delta, &des[0], &des[1], &des[2], &des[3], &dq, &dqs[0], &dqs[1], &dqs[2],
                      &dqs[3], &dk, &dks[0], &dks[1], &dks[2], &dv, &dvs[0], &dvs[1], &dvs[2], &B,
                      &H, &G, &R, &D, &Dv, &T, &k0, &N, &q0, &scale, &cap, &slopes, &qpos, &f32,
                      &source) ||
        !source_of(source, f32, "backward", &src))
        return 0;
    if (o ? dq || dk || dv : !dq || !dk || !dv) {
        PyErr_SetString(PyExc_ValueError,
                        o ? "backward: a pass that rounds its gradients (grads) takes no call's "
                            "dq, dk or dv (0)"
                          : "backward: each call needs dq, dk and dv (or the pass, grads)");
        return 0;
    }
    if (o && (B != o->B || H != o->H || G != o->G || D != o->D || Dv != o->Dv || T != o->Tk ||
              q0 < 0 || q0 + R > o->Tq)) {
        PyErr_SetString(PyExc_ValueError,
                        "backward: a call's B, H, G, D, D_v, T or rows q0..q0+R do not fit grads");
        return 0;
    }
    memset(bj, 0, sizeof *bj);
    Job *j = &bj->f;
    Seg keys;
    if (!call_sizes(j, "backward", B, H, G, R, D, Dv, scale, cap, f32, threads) ||
        !key_range(&keys, "backward", T < 0 ? 0 : (T + 31) / 32 * 32 + 32, k0, N))
        return 0;
    if (k0 + N > T) {
        PyErr_SetString(PyExc_ValueError, "backward: the call's keys must lie within K and V");
        return 0;
    }
    j->begin = keys.begin, j->lead = keys.lead, j->N = keys.N, j->src = src;
    j->slopes = (const float *)(uintptr_t)slopes, j->qpos = qpos;
    j->blocking = step_blocking[1];
    j->q = (const void *)(uintptr_t)q;
    j->vp = (const void *)(uintptr_t)k; /* float32 reads K's rows in place for dS K */
    j->bias = (const float *)(uintptr_t)bias;
    j->bounds = (const int32_t *)(uintptr_t)bounds, j->bnb = bnb;
    bj->dout = (const void *)(uintptr_t)dout;
    bj->k = (Pack){(const void *)(uintptr_t)k, {kst[0], kst[1], kst[2]}, NULL, 0, D, src};
    bj->v = (Pack){(const void *)(uintptr_t)v, {vst[0], vst[1], vst[2]}, NULL, 0, Dv, src};
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
    if (o) { /* the call's rows of the head's sums, and their layout's strides */
        int64_t Dp = pad32(D), Dvp = pad32(Dv), kv = G * o->Tq * Dp;
        bj->at[0] = q0 * Dp, bj->at[1] = kv + k0 * Dp, bj->at[2] = kv + o->Tk * Dp + k0 * Dvp;
        bj->dqs[2] = o->Tq * Dp, bj->dqs[3] = Dp, bj->dks[2] = Dp, bj->dvs[2] = Dvp;
    }
    j->parts = 2;
    bj->blocks = ((j->lead + N + 31) / 32 * 32 + KB - 1) / KB;
    return 1;
}

/* Every call of a backward pass (one B, H) in one parallel region, its gradients rounded
   by the pass where o is not NULL (Rounded); see Pass. */
static PyObject *run_backward(PyObject *list, int threads, Rounded *o) {
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
        if (!parse_backward(&ps.calls[c], one, threads, o)) {
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
        ps.sums = calloc((size_t)(ps.B * ps.H > 0 ? ps.B * ps.H : 1), sizeof(float *));
        if (!ps.pending || !ps.committed || !ps.sums) failed = PyErr_NoMemory();
        if (o && n > 0) o->isa = ps.calls[0].f.isa, ps.rounded = o;
    }
    if (!failed) {
#ifdef QKV_STEP
        int64_t items = ps.start[n];
        if (threads > items) threads = items > 0 ? (int)items : 1;
        const int by_heads = ps.B * ps.H >= HEADS_PER_THREAD * threads;
        LOCK_INIT(&ps.lock);
        Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads)
        {
            if (by_heads) head_worker(&ps);
            else backward_worker(&ps);
        }
        Py_END_ALLOW_THREADS LOCK_FREE(&ps.lock);
        for (int64_t i = 0; i < ps.B * ps.H * ps.chain; i++) free(ps.pending[i].mem);
        for (int64_t i = 0; i < ps.B * ps.H; i++) free(ps.sums[i]);
        if (ps.done != items || ps.nomem) failed = PyErr_NoMemory(); /* none for an item */
        if (o && items == 0) zero_grads(o); /* (else every head was rounded) */
#endif
    }
    free(ps.calls), free(ps.start), free(ps.chain0), free(ps.pending), free(ps.committed);
    free(ps.sums);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* backward_many's `grads` (a dict; None: each call's dq, dk and dv) into o; 0 with a
   Python error set if it does not parse. */
static int parse_grads(PyObject *grads, Rounded *o) {
    unsigned long long dq, dk, dv;
    long long dqs[4], dks[3], dvs[3], B, H, G, Tq, Tk, D, Dv;
    const char *dtype;
    static char *names[] = {"dq", "dk", "dv", "sizes", "dtype", NULL};
    if (!parse_fields(grads, "backward_many: grads", "$(KLLLL)(KLLL)(KLLL)(LLLLLLL)s", names, &dq,
                      &dqs[0], &dqs[1], &dqs[2], &dqs[3], &dk, &dks[0], &dks[1], &dks[2], &dv,
                      &dvs[0], &dvs[1], &dvs[2], &B, &H, &G, &Tq, &Tk, &D, &Dv, &dtype))
        return 0;
    *o = (Rounded){(uint16_t *)(uintptr_t)dq, (uint16_t *)(uintptr_t)dk, (uint16_t *)(uintptr_t)dv};
    o->dst = !strcmp(dtype, "bfloat16") ? SRC_BF16 : !strcmp(dtype, "float16") ? SRC_F16 : -1;
    if (o->dst < 0 || B < 0 || H < 0 || G < 1 || Tq < 0 || Tk < 0 || D < 1 || Dv < 1) {
        PyErr_Format(PyExc_ValueError,
                     "backward_many: grads in \"bfloat16\" or \"float16\" (not \"%s\"), "
                     "sizes (B, H, G, Tq, Tk, D, D_v) with G, D and D_v at least 1",
                     dtype);
        return 0;
    }
    memcpy(o->dqs, dqs, sizeof dqs), memcpy(o->dks, dks, sizeof dks),
        memcpy(o->dvs, dvs, sizeof dvs);
    o->B = B, o->H = H, o->G = G, o->Tq = Tq, o->Tk = Tk, o->D = D, o->Dv = Dv;
    return 1;
}

static PyObject *backward_many(PyObject *self, PyObject *args, PyObject *kwargs) {
    PyObject *list, *grads = Py_None;
    int threads;
    Rounded o;
    static char *names[] = {"calls", "threads", "grads", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!i|$O", names, &PyList_Type, &list, &threads,
                                     &grads))
        return NULL;
    if (grads != Py_None && !parse_grads(grads, &o)) return NULL;
    return run_backward(list, threads, grads != Py_None ? &o : NULL);
}

static PyMethodDef methods[] = {
    {"available", available, METH_VARARGS,
     "available(float32): whether this CPU runs the kernel in float32 (AVX-512, AVX2 + FMA, "
     "or NEON) or in bfloat16 dot products (AVX512-BF16, or BFDOT)."},
    {"isa", isa_py, METH_VARARGS,
     "isa(float32): the instruction set the kernel runs on in float32 or bfloat16 here: "
     "\"avx512\", \"avx2\", \"sve\", \"neon\", or \"\" (none)."},
    {"openmp", openmp, METH_NOARGS,
     "openmp(): whether this build runs its passes on OpenMP threads (else in one thread)."},
    {"use_isa", use_isa, METH_VARARGS,
     "use_isa(name): \"avx2\" runs the kernel as on an AVX2-only CPU where this one has "
     "AVX-512 too (float32 on the AVX2 step, no bfloat16 dot products: to test and measure "
     "it); \"neon\" runs the NEON step where the CPU has SVE; \"\" lets the CPU choose. "
     "Returns the setting before."},
    {"use_blocking", use_blocking, METH_VARARGS,
     "use_blocking(blocking, backward=False): the forward's steps (or, with backward, the "
     "backward's) in their first blocking (0) or their second (1): AVX-512 tiles of 8 query "
     "rows or 16, AVX2, NEON and SVE 3 rows in registers or 2 (the same bits either way; the "
     "machine's profile measures which is faster, forward and backward apart). Returns the "
     "setting before."},
    {"row_dots", (PyCFunction)(void (*)(void))row_dots, METH_VARARGS | METH_KEYWORDS,
     "row_dots(*, a, b, out, n, D, source): out[r] = sum of a[r] * b[r] over n contiguous "
     "rows of D values of the dtype `source` names, widened as read, into float32 out; one "
     "thread."},
    {"finite", (PyCFunction)(void (*)(void))finite_py, METH_VARARGS | METH_KEYWORDS,
     "finite(*, x, n, source): whether n contiguous values at x, of the dtype `source` "
     "names (\"float32\", \"bfloat16\", \"float16\"), are all finite, in one thread."},
    {"backward_many", (PyCFunction)(void (*)(void))backward_many, METH_VARARGS | METH_KEYWORDS,
     "backward_many(calls, threads, *, grads=None): every call (one B and H) in one parallel "
     "region, the gradients added in one fixed order. A call is a dict: q=(ptr, *4 strides), "
     "dout=(ptr, *4), k=(ptr, *3), v=(ptr, *3), bias=(ptr|0, *3), bounds=(ptr|0, *1), "
     "lse=(ptr, *4), delta=(ptr, *4), dq=(ptr, *4), dk=(ptr, *3), dv=(ptr, *3), "
     "sizes=(B, H, G, R, D, D_v), keys=(T, k0, N), q0, scale, softcap, alibi=(slopes|0, qpos), "
     "float32, source: its gradients added in float32 to dq (in key-block order), dk and dv; K "
     "(B, H, T, D) and V (B, H, T, D_v) as they are. float32: computed in float32 (else "
     "bfloat16 dot products); source: what q, dout, k and v hold (\"float32\", "
     "\"bfloat16\", \"float16\"; widened to float32 as they are loaded). grads, a dict "
     "dq=(ptr, *4), dk=(ptr, *3), dv=(ptr, *3), sizes=(B, H, G, Tq, Tk, D, D_v), dtype "
     "(\"bfloat16\" or \"float16\"): the pass's gradients of every head, (B, H, G, Tq, D), "
     "(B, H, Tk, D), (B, H, Tk, D_v), summed per head in float32 and written rounded to "
     "dtype; each call's dq, dk and dv are then 0, and its rows q0.. of dq, keys k0.. of dk "
     "and dv its share."},
    {"pack", (PyCFunction)(void (*)(void))pack_py, METH_VARARGS | METH_KEYWORDS,
     "pack(*, packs, sizes=(B, H, T, Nt), threads, float32, source): tensors holding "
     "`source` into the kernel's score layout (values 0; float32's, widened, or "
     "bfloat16's) or bfloat16's value layout (1), in one parallel region; a pack is a dict "
     "x=(ptr, *3 strides), dst, values, D (its head dim)."},
    {"attend_many", (PyCFunction)(void (*)(void))attend_many, METH_VARARGS | METH_KEYWORDS,
     "attend_many(*, calls, threads): every call in one parallel region, their work items "
     "dealt from one counter. A call is a dict: q=(ptr, *4 strides), k=(kp, *2), "
     "v=(vp, *2), ranges=[dict k0, N, bias=(ptr|0, *3), bounds=(ptr|0, *1)], "
     "out=(ptr, *4), lse=(ptr, *4), sizes=(B, H, G, R, D, D_v), Nt, scale, softcap, "
     "alibi=(slopes|0, qpos), p_parts, float32, source (as backward_many's), out_dtype "
     "(\"float32\" or the source's): the step over key ranges of the packed buffers (one "
     "online softmax across them), into out and lse (float32)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "_native",
    "qkv's native attention step (AVX-512, AVX2 or NEON; bfloat16: AVX512-BF16, BFDOT).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
