/* qkv's native decode step over a paged KV cache: one query per sequence attends that
   sequence's keys where they lie, in its pages, read through its block table — no gather
   into a contiguous copy first (qkv/kernels/paged.py).

   Work: one item per (sequence, key/value head); the item's G = H / H_kv query heads share
   every key and value row it reads. In torch's layout, where a slot's key/value heads lie
   side by side, the vector item takes several of a sequence's key/value heads at once and
   goes through its pages once for all of them (_paged_step.h). Per page: the G × n scores,
   their maximum, one rescale of the running sum and output, then P·V. Scores, softmax state
   and output accumulate in float32: bfloat16 keys and values are widened as they are read,
   and quantized ones (int8, or float8 e4m3) are read in place, widened and multiplied by
   their row's scale (one float32 per token and key/value head) — no dequantized copy is
   made. A key with a NaN or an infinite score makes its row NaN, as plain arithmetic would;
   a sequence with no key gives out 0 and lse -inf (the sink's logit with sinks).

   Threads: one OpenMP parallel region per call on the pool torch has loaded, the items
   dealt one at a time (schedule dynamic): a thread that is descheduled on a busy machine
   holds up only the item it is on, the others take the rest. Each item's arithmetic is the
   same whichever thread runs it, so the result does not depend on the thread count.

   Layout. q: (B, H, D) with strides qs[0..1], D contiguous; pages k, v: element strides
   over (page, slot, kv head) ks/vs[0..2], D contiguous (qkv's pool (H_kv, pages, P, D) and
   torch's (pages, P, H_kv, D) both are); table: int32 (B, max_pages) contiguous; lengths:
   int32 (B,); sinks: float32 (H,) or NULL; out: float32 (B, H, D_v) contiguous; lse:
   float32 (B, H); quantized pages' scales: float32, element strides over (page, slot, kv
   head) kss/vss[0..2].

   Code: for head dims that are multiples of 16, the vector item of _paged_step.h, compiled
   per instruction set (_paged512.c, _paged256.c, _paged128.c: AVX-512, AVX2, ARM64 NEON)
   and chosen at run time; AVX-512 also has its own item for 16 or more query heads per
   key/value head (wide512, here). Other sizes run the plain C item, compiled on x86-64 for
   AVX-512, AVX2 and plain x86-64, the loader picking one (target_clones). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "_cpu.h"
#include "_fields.h"
#include "_paged.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QKV_X86 1
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

/* One (sequence b, kv head h) item, in plain C for any sizes. work: per-thread scratch of
   scratch_floats (_paged.h). */
CLONES
static void item(const Job *j, int64_t b, int64_t hk, float *work) {
    const int64_t G = j->H / j->H_kv, D = j->D, D_v = j->D_v, P = j->P;
    /* acc, l, mt: the totals; part, lp: the stretch's sums under m (fold) */
    float *qf = work, *acc = qf + G * D, *part = acc + G * D_v, *s = part + G * D_v;
    float *kbuf = s + G * P, *vbuf = kbuf + D;
    float m[G > 0 ? G : 1], lp[G > 0 ? G : 1], l[G > 0 ? G : 1], mt[G > 0 ? G : 1];
    begin(j, b, hk, qf, part, m, lp, kbuf);
    zero_sums(G, D_v, acc, l, mt);
    const int64_t len = j->lengths[b];
    for (int64_t p0 = 0, page_i = 0, stretch = 0; p0 < len; p0 += P, page_i++) {
        const int64_t page = j->table[b * j->max_pages + page_i];
        const int64_t n = len - p0 < P ? len - p0 : P;
        for (int64_t t = 0; t < n; t++) {
            const float *kr = kv_row(j, 1, page, t, hk, D, kbuf);
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qf + g * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qg[d] * kr[d];
                s[g * P + t] = dot;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float mx = m[g];
            for (int64_t t = 0; t < n; t++) mx = s[g * P + t] > mx ? s[g * P + t] : mx;
            if (mx > m[g]) { /* a new maximum: rescale what was summed under the old one */
                const float alpha = m[g] == -INFINITY ? 0.0f : expf(m[g] - mx);
                lp[g] *= alpha;
                for (int64_t d = 0; d < D_v; d++) part[g * D_v + d] *= alpha;
                m[g] = mx;
            }
            /* Every score so far -inf: no weight (exp(-inf - -inf) would be NaN). */
            for (int64_t t = 0; t < n; t++)
                s[g * P + t] = m[g] == -INFINITY && s[g * P + t] == -INFINITY
                                   ? 0.0f
                                   : expf(s[g * P + t] - m[g]);
        }
        for (int64_t t = 0; t < n; t++) {
            const float *vr = kv_row(j, 0, page, t, hk, D_v, vbuf);
            for (int64_t g = 0; g < G; g++) {
                const float w = s[g * P + t];
                float *a = part + g * D_v;
                lp[g] += w;
#pragma omp simd
                for (int64_t d = 0; d < D_v; d++) a[d] += w * vr[d];
            }
        }
        stretch += n;
        if (stretch >= FOLD_KEYS / 4 || p0 + n >= len) {
            fold(G, D_v, acc, l, mt, part, lp, m);
            stretch = 0;
        }
    }
    finish(j, b, hk, acc, mt, l);
}

/* The vector item this CPU runs (NULL: the plain C one): AVX-512, else AVX2 + FMA + F16C
   (also where pinned: use_isa), on x86-64; on ARM64 SVE where its vectors are 256 bits
   and the SVE item is built (not where pinned to NEON), else NEON. */
static int pinned = PIN_NONE;

static const Item *vector_items(void) {
#if defined(QKV_X86)
    if (qkv_cpu_avx512() && pinned != PIN_AVX2) return qkv_paged_avx512;
    if (qkv_cpu_avx2()) return qkv_paged_avx2;
    return NULL;
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#ifdef QKV_SVE
    if (qkv_cpu_sve256() && pinned != PIN_NEON) return qkv_paged_sve;
#endif
    return qkv_paged_neon;
#else
    return NULL;
#endif
}

/* Whether bfloat16 queries' scores take bfloat16 dot products here (the AVX-512 item
   compiled with them, _paged512_dots.c: AVX512-BF16, not pinned to AVX2). The dispatch
   takes it for D a multiple of 32 and two or more query heads per key/value head: with
   one, the step is bound by memory and the dot products' item ran slower on Zen 4
   (bfloat16 pages 1.24-1.45x its time; docs/head-shapes.md). */
static int dots_here(void) {
#if defined(QKV_X86)
    return vector_items() == qkv_paged_avx512 && qkv_cpu_bf16();
#else
    return 0;
#endif
}

static PyObject *dots(PyObject *self, PyObject *args) { return PyBool_FromLong(dots_here()); }

/* Pins the vector item to AVX2 ("avx2") where the CPU has AVX-512 too, to NEON ("neon")
   where it has SVE, or lets the CPU choose (""); returns the setting before. */
static PyObject *use_isa(PyObject *self, PyObject *args) {
    int pin = pin_named(args);
    if (pin < 0) return NULL;
    PyObject *before = PyUnicode_FromString(pin_name(pinned));
    pinned = pin;
    return before;
}

/* The instruction set of the vector item this CPU runs: "avx512", "avx2", "sve", "neon" or
   "". */
static PyObject *isa(PyObject *self, PyObject *args) {
    const Item *items = vector_items();
    const char *name = "";
#if defined(QKV_X86)
    name = items == qkv_paged_avx512 ? "avx512" : items == qkv_paged_avx2 ? "avx2" : "";
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
    name = items == qkv_paged_neon ? "neon" : items ? "sve" : "";
#endif
    return PyUnicode_FromString(name);
}

static PyObject *decode(PyObject *self, PyObject *args, PyObject *kwargs) {
    unsigned long long q, k, v, table, lengths, sinks, out, lse, ksc, vsc;
    long long qs0, qs1, ks0, ks1, ks2, vs0, vs1, vs2, B, H, H_kv, D, D_v, P, max_pages, num_pages;
    long long kss[3], vss[3];
    double scale;
    int is_bf16, threads, kv, quantized_dots;
    static char *names[] = {
        "q",         "k",           "v",       "table",          "lengths",  "sinks",
        "out",       "lse",         "sizes",   "scale",          "bfloat16", "kv_storage",
        "key_scale", "value_scale", "threads", "quantized_dots", NULL};
    if (PyTuple_GET_SIZE(args)) {
        PyErr_SetString(PyExc_TypeError, "decode takes named fields only");
        return NULL;
    }
    if (!parse_fields(kwargs ? kwargs : Py_None, "decode",
                      "$(KLL)(KLLL)(KLLL)(KLL)KKKK(LLLLLL)dii(KLLL)(KLLL)ii", names, &q, &qs0, &qs1,
                      &k, &ks0, &ks1, &ks2, &v, &vs0, &vs1, &vs2, &table, &max_pages, &num_pages,
                      &lengths, &sinks, &out, &lse, &B, &H, &H_kv, &D, &D_v, &P, &scale, &is_bf16,
                      &kv, &ksc, &kss[0], &kss[1], &kss[2], &vsc, &vss[0], &vss[1], &vss[2],
                      &threads, &quantized_dots))
        return NULL;
    if (B < 0 || H_kv <= 0 || H <= 0 || H % H_kv || D <= 0 || D_v <= 0 || P <= 0 || max_pages < 0 ||
        threads < 1 || kv < KV_F32 || kv > KV_F8 || ((kv >= KV_I8) != (ksc && vsc))) {
        PyErr_SetString(PyExc_ValueError, "paged decode: sizes out of range");
        return NULL;
    }
    Job j = {(const void *)q,
             (const void *)k,
             (const void *)v,
             (const int32_t *)table,
             (const int32_t *)lengths,
             (const float *)sinks,
             (float *)out,
             (float *)lse,
             {qs0, qs1},
             {ks0, ks1, ks2},
             {vs0, vs1, vs2},
             B,
             H,
             H_kv,
             D,
             D_v,
             P,
             max_pages,
             (float)scale,
             is_bf16,
             kv,
             (const float *)ksc,
             (const float *)vsc,
             {kss[0], kss[1], kss[2]},
             {vss[0], vss[1], vss[2]},
             0};
    /* The table and lengths, checked before anything is read through them: a length past
       the table or a page outside the pool returns False (the caller says which). */
    const int32_t *tab = (const int32_t *)table, *len = (const int32_t *)lengths;
    for (int64_t b = 0; b < B; b++) {
        if (len[b] < 0 || len[b] > max_pages * P) Py_RETURN_FALSE;
        for (int64_t i = 0; i < (len[b] + P - 1) / P; i++)
            if (tab[b * max_pages + i] < 0 || tab[b * max_pages + i] >= num_pages) Py_RETURN_FALSE;
    }
    const int64_t G = H / H_kv;
    Item run = item;
    const Item *vector = vector_items();
    if (D % 16 == 0 && D_v % 16 == 0 && vector) run = vector[kv];
#ifdef QKV_X86
    if (D % 16 == 0 && D_v % 16 == 0 && vector == qkv_paged_avx512 && G >= 16)
        run = qkv_paged_avx512_wide[kv];
    else if (D % 32 == 0 && D_v % 16 == 0 && G >= 2 && is_bf16 && kv != KV_F32 && dots_here() &&
             (kv == KV_BF16 || quantized_dots))
        run = qkv_paged_avx512_dots[kv];
#endif
    /* Where a slot's heads lie side by side (torch's layout) the vector item takes several
       key/value heads of a sequence, as many as leave 4 items a thread, and reads each page
       of them as one stretch of memory (one head's rows are H_kv rows apart there); qkv's
       pool keeps each head's pages together, so its items take one. */
    if (vector && run == vector[kv] && ks2 < ks1 && vs2 < vs1)
        for (int64_t n = H_kv; n > 1 && j.heads == 0; n--)
            if (H_kv % n == 0 && B * (H_kv / n) >= 4 * threads) j.heads = n;
    const int64_t per_seq = H_kv / heads_per_item(&j), items = B * per_seq;
    const size_t scratch = (size_t)scratch_floats(G, D, D_v, P, heads_per_item(&j));
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *work = malloc(scratch * sizeof(float));
        if (!work) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++)
            if (work) run(&j, i / per_seq, i % per_seq * heads_per_item(&j), work);
        free(work);
    }
    Py_END_ALLOW_THREADS if (failed) return PyErr_NoMemory();
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"use_isa", use_isa, METH_VARARGS,
     "use_isa(name): \"avx2\" runs the AVX2 item where the CPU has AVX-512 too (to test and "
     "measure it), \"neon\" the NEON item where it has SVE; \"\" lets the CPU choose. "
     "Returns the setting before."},
    {"isa", isa, METH_NOARGS,
     "isa(): the vector item this CPU runs (\"avx512\", \"avx2\", \"sve\", \"neon\"; \"\": plain C "
     "only)."},
    {"dots", dots, METH_NOARGS,
     "dots(): whether bfloat16 queries are scored with bfloat16 dot products here "
     "(AVX512-BF16) where D is a multiple of 32 and 2+ query heads share a key/value head."},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_VARARGS | METH_KEYWORDS,
     "decode(*, q=(ptr, *2 strides), k=(pages ptr, *3), v=(pages ptr, *3), "
     "table=(ptr, max_pages, num_pages), lengths, sinks (0: none), out, lse, "
     "sizes=(B, H, H_kv, D, D_v, P), scale, bfloat16 (q's dtype), kv_storage (0 float32, 1 "
     "bfloat16, 2 int8, 3 float8 e4m3), key_scale=(ptr|0, *3), value_scale=(ptr|0, *3), "
     "threads): one query per sequence over its pages, into out and lse (float32); False "
     "(nothing computed) if a length or a page it needs is out of range."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT,
                                    "_paged",
                                    "qkv's native decode step over a paged KV cache.",
                                    -1,
                                    methods,
                                    NULL,
                                    NULL,
                                    NULL,
                                    NULL};

PyMODINIT_FUNC PyInit__paged(void) { return PyModule_Create(&module); }
