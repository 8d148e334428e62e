/* The paged decode step's vector item (src/qkv/kernels/_paged_step.h) against a float64
   reference, with no Python: one decode call per case over pages read through a block
   table, keys and values stored as float32, bfloat16, int8 or float8 e4m3 (the last two
   with a scale per row), GQA, a sequence with no token, float32 and bfloat16 queries, for
   every vector item this machine runs (x86-64: AVX-512 and AVX2 where the CPU has them, and
   AVX-512's item that scores bfloat16 queries with bfloat16 dot products where it has
   AVX512-BF16; ARM64: NEON, and SVE where its vectors are 256 bits, under qemu-user in
   tests/kernels/test_toolchains.py). Prints a line per
   case and exits 1 if any is out of tolerance. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../../src/qkv/kernels/_cpu.h"
#include "../../../src/qkv/kernels/_paged.h"

static uint64_t state = 2463534242ull;

static double uniform(void) { /* xorshift64, in (0, 1) */
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return ((double)(state >> 11) + 0.5) / 9007199254740992.0;
}

static double normal(void) { return sqrt(-2.0 * log(uniform())) * cos(6.2831853 * uniform()); }

/* A value of the storage kind stored at x[i]; returns its stored value (before the row's
   scale), decoded here independently of the kernel. */
static double store(void *x, int64_t i, int kind) {
    if (kind == KV_F32) return ((float *)x)[i] = (float)normal();
    if (kind == KV_BF16) {
        float f = (float)normal();
        uint32_t u;
        memcpy(&u, &f, 4);
        ((uint16_t *)x)[i] = (uint16_t)(u >> 16);
        u &= 0xffff0000u;
        memcpy(&f, &u, 4);
        return f;
    }
    if (kind == KV_I8) {
        int8_t v = (int8_t)(uniform() * 255.0 - 127.5);
        ((int8_t *)x)[i] = v;
        return v;
    }
    uint8_t b; /* float8 e4m3 "fn": any byte but the two NaNs */
    do b = (uint8_t)(uniform() * 256.0);
    while ((b & 0x7F) == 0x7F);
    ((uint8_t *)x)[i] = b;
    int e = (b >> 3) & 0xF, m = b & 7;
    double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
    return b & 0x80 ? -v : v;
}

static int run_case(const char *isa, Item item, int kind, int64_t H, int64_t H_kv, int64_t D,
                    int64_t Dv, int64_t heads, int qbf16) {
    const int64_t B = 3, P = 32, max_pages = 5, pages = 12, G = H / H_kv;
    const int64_t len[3] = {37, 0, 80};
    const int32_t table[3][5] = {{3, 7, 0, 1, 2}, {5, 1, 2, 9, 4}, {11, 4, 6, 8, 10}};
    int32_t lengths[3] = {37, 0, 80};
    size_t unit = kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1;
    void *k = malloc(pages * P * H_kv * D * unit), *v = malloc(pages * P * H_kv * Dv * unit);
    double *kd = malloc(sizeof(double) * pages * P * H_kv * D);
    double *vd = malloc(sizeof(double) * pages * P * H_kv * Dv);
    float *q = malloc(sizeof(float) * B * H * D), *ksc = NULL, *vsc = NULL;
    uint16_t *qh = malloc(sizeof(uint16_t) * B * H * D); /* q as bfloat16, where qbf16 */
    for (int64_t i = 0; i < pages * P * H_kv * D; i++) kd[i] = store(k, i, kind);
    for (int64_t i = 0; i < pages * P * H_kv * Dv; i++) vd[i] = store(v, i, kind);
    for (int64_t i = 0; i < B * H * D; i++) {
        q[i] = (float)normal();
        if (qbf16) { /* the kernel reads the bfloat16 bits; the reference their value */
            uint32_t u;
            memcpy(&u, &q[i], 4);
            qh[i] = (uint16_t)(u >> 16);
            u &= 0xffff0000u;
            memcpy(&q[i], &u, 4);
        }
    }
    if (kind >= KV_I8) { /* a scale per (page, slot, kv head) */
        ksc = malloc(sizeof(float) * pages * P * H_kv),
        vsc = malloc(sizeof(float) * pages * P * H_kv);
        for (int64_t i = 0; i < pages * P * H_kv; i++)
            ksc[i] = (float)(0.05 * uniform()), vsc[i] = (float)(0.05 * uniform());
    }
    const double scale = 1.0 / sqrt((double)D);
    float *out = malloc(sizeof(float) * B * H * Dv), *lse = malloc(sizeof(float) * B * H);
    Job j = {qbf16 ? (const void *)qh : q,
             k,
             v,
             &table[0][0],
             lengths,
             NULL,
             out,
             lse,
             {H * D, D},
             {P * H_kv * D, H_kv * D, D},
             {P * H_kv * Dv, H_kv * Dv, Dv},
             B,
             H,
             H_kv,
             D,
             Dv,
             P,
             max_pages,
             (float)scale,
             qbf16,
             kind,
             ksc,
             vsc,
             {P * H_kv, H_kv, 1},
             {P * H_kv, H_kv, 1},
             heads};
    float *work = malloc(sizeof(float) * scratch_floats(G, D, Dv, P, heads_per_item(&j)));
    for (int64_t b = 0; b < B; b++)
        for (int64_t hk = 0; hk < H_kv; hk += heads_per_item(&j)) item(&j, b, hk, work);
    double worst = 0, worst_lse = 0;
    double *s = malloc(sizeof(double) * 80);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t hk = h / G;
            double mx = -INFINITY, sum = 0;
            for (int64_t i = 0; i < len[b]; i++) {
                int64_t at = (table[b][i / P] * P + i % P) * H_kv + hk;
                double dot = 0;
                for (int64_t d = 0; d < D; d++) dot += q[(b * H + h) * D + d] * kd[at * D + d];
                s[i] = dot * scale * (ksc ? ksc[at] : 1.0);
                mx = s[i] > mx ? s[i] : mx;
            }
            for (int64_t i = 0; i < len[b]; i++) sum += exp(s[i] - mx);
            double want_lse = sum > 0 ? mx + log(sum) : -INFINITY;
            for (int64_t d = 0; d < Dv; d++) {
                double o = 0;
                for (int64_t i = 0; i < len[b]; i++) {
                    int64_t at = (table[b][i / P] * P + i % P) * H_kv + hk;
                    o += exp(s[i] - want_lse) * vd[at * Dv + d] * (vsc ? vsc[at] : 1.0);
                }
                worst = fmax(worst, fabs(out[(b * H + h) * Dv + d] - o));
            }
            float got = lse[b * H + h];
            int both = isinf(want_lse) && isinf(got) && got < 0;
            worst_lse = fmax(worst_lse, both ? 0 : fabs(got - want_lse));
        }
    const char *name[4] = {"float32", "bfloat16", "int8", "e4m3"};
    int ok = worst <= 2e-5 && worst_lse <= 2e-5;
    printf("%s %-11s q %-8s %-8s H=%2lld H_kv=%lld D=%3lld Dv=%3lld heads/item %lld: out %.1e "
           "lse %.1e\n",
           ok ? "ok  " : "FAIL", isa, qbf16 ? "bfloat16" : "float32", name[kind], (long long)H,
           (long long)H_kv, (long long)D, (long long)Dv, (long long)heads_per_item(&j), worst,
           worst_lse);
    free(k), free(v), free(kd), free(vd), free(q), free(qh), free(ksc), free(vsc), free(out);
    free(lse);
    free(work), free(s);
    return ok;
}

int main(void) {
    const char *names[3];
    const Item *items[3];
    int n = 0;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        names[n] = "avx512", items[n++] = qkv_paged_avx512;
    if (n && __builtin_cpu_supports("avx512bf16"))
        names[n] = "avx512-dots", items[n++] = qkv_paged_avx512_dots;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        names[n] = "avx2", items[n++] = qkv_paged_avx2;
#elif defined(__aarch64__)
    names[n] = "neon", items[n++] = qkv_paged_neon;
#ifdef QKV_SVE
    if (qkv_cpu_sve256()) names[n] = "sve", items[n++] = qkv_paged_sve;
#endif
#endif
    /* G = 2, 2, 1; 5 (a block of 4 heads and one more, 64 + 16 value columns) and 8 (two
       blocks; float8 keys widened into a page first where a block holds fewer heads); each
       with one key/value head an item and with all of them */
    const int64_t shapes[][4] = {
        {4, 2, 64, 64}, {6, 3, 32, 16}, {8, 8, 128, 96}, {10, 2, 48, 80}, {16, 2, 128, 128}};
    /* (and with bfloat16 queries the dot products' item scores D = 64, 32 and 128; 48 not) */
    const int nshapes = sizeof shapes / sizeof shapes[0];
    int failed = 0, cases = 0;
    for (int i = 0; i < n; i++)
        for (int kind = KV_F32; kind <= KV_F8; kind++)
            for (int c = 0; c < nshapes; c++)
                for (int e = 0; e < 4; e++, cases++)
                    failed +=
                        !run_case(names[i], items[i][kind], kind, shapes[c][0], shapes[c][1],
                                  shapes[c][2], shapes[c][3], e & 1 ? shapes[c][1] : 1, e >> 1);
    printf("%d of %d cases within tolerance\n", cases - failed, cases);
    return failed || !n ? 1 : 0;
}
