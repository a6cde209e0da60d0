/* bf16 and float32 linear layers and attention for the decode step on x86 CPUs with AVX-512 BF16 (cpu_kernels.py
 * compiles and loads this file), bf16 and float32 decoder layers in one call, the argmax / top-k of logits rows, and
 * sampled tokens (penalty, temperature, min-p, Gumbel-max). float32
 * accumulation (bf16: vdpbf16ps, results rounded to bf16 once). Every output is computed alone and in one order: a
 * row's result does not depend on which rows run beside it, nor on the thread count. The quantized self-drafter's
 * layers: 4-bit products and an attention over int8 K/V codes (vpdpbusd / vpdpwssd, AVX-512 VNNI).
 */
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define ROWS 8  /* input rows per pass over a column block: 8 accumulators */
/* bf16 products of 9 .. WIDE_UPTO rows (a batched verify) take passes of up to 16 rows: the weights then stream from
 * memory once rather than once per 8 rows, which pays while a pass is bound by memory more than by arithmetic; more rows
 * run in passes of 8 from cache, where the 16-accumulator pass is the slower one (docs/benchmarks.md, stop 77) */
#define WIDE_UPTO 24
/* bytes ahead of the weight stream to prefetch, one line a step, for passes of 2 rows or more (a block's packed weights
 * are contiguous and the next block follows, so this runs into the next block; a prefetch never faults, even past the
 * end). Measured on smollm2's products against prefetching the whole next block at its start (which overfills L1:
 * 18-48 KB blocks): 1.6x faster at 8 rows, 1.4x at 16. 4096 bytes ahead against 1024, 6 rows, cold 3,072 x 576
 * products, 2 threads: ~30 against ~26.5 GB/s while this shared host's bandwidth probe read 45-52 GB/s, the same at
 * 30 (the verify's products; in the engine, speculative +3.8% over 7 alternating pairs). A one-row pass streams faster
 * on the hardware prefetcher alone (bf16 35 against 29 GB/s, 4-bit 28 against 24.5 at a 46-53 GB/s probe; +6% and
 * +2.5% at 28-31), 6 rows slower (15-18 against 20-24 GB/s at 30) */
#define PREFETCH 4096
#define KEYS 4  /* attention: keys scored side by side (each key's sum still in one order) */

/* A column block's results for MB rows: + bias (float32, or none), rounded to bf16 once, its live columns stored */
static inline __attribute__((always_inline)) void store_block_bf16(const __m512 *acc, int MB, const float *b,
                                                                   uint16_t *y, int N, int n0) {
    __mmask16 live = N - n0 >= 16 ? 0xffff : (1u << (N - n0)) - 1;
    for (int m = 0; m < MB; m++) {
        __m512 r = b ? _mm512_add_ps(acc[m], _mm512_maskz_loadu_ps(live, b + n0)) : acc[m];
        _mm256_mask_storeu_epi16(y + (long)m * N + n0, live, (__m256i)_mm512_cvtneps_pbh(r));
    }
}

/* acc + w . (the bf16 pair at p, in every lane): vdpbf16ps with its pair broadcast from memory inside the instruction
 * ({1to16}), which compilers do not emit for _mm512_set1_epi32: one instruction a row instead of two */
typedef int32_t __attribute__((may_alias)) pair_t;  /* two bf16 read as one (the asm's memory operand) */
static inline __attribute__((always_inline)) __m512 dot_pair(__m512 acc, __m512bh w, const uint16_t *p) {
    __asm__("vdpbf16ps %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*(const pair_t *)p), "v"(w));
    return acc;
}

/* Weights are packed once (cpu_kernels.py pack) as [ceil(N/16), K/2, 16, 2]: block nb, pair kp holds, for its 16
 * output columns, the weights of inputs 2kp and 2kp+1, so one 64-byte load feeds vdpbf16ps against a broadcast pair of
 * x: the 16 lanes are 16 outputs and no horizontal sums are needed. Memory-bound for a few rows (the packed weights are
 * read once, PREFETCH bytes ahead from 2 rows on), compute-bound for many (a block's later passes read it from cache). */
#define BLOCK(MB)                                                                                                  \
    static inline __attribute__((always_inline)) void block_##MB(const uint16_t *x, const uint16_t *pb,            \
                                                                 const float *b, uint16_t *y, int N, int K, int n0) { \
        __m512 acc[MB];                                                                                            \
        for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();                                                 \
        for (int kp = 0; kp < K / 2; kp++) {                                                                       \
            if (MB > 1) _mm_prefetch((const char *)(pb + kp * 32) + PREFETCH, _MM_HINT_T0);                        \
            __m512bh w = (__m512bh)_mm512_loadu_si512(pb + kp * 32);                                               \
            for (int m = 0; m < MB; m++) acc[m] = dot_pair(acc[m], w, x + (long)m * K + 2 * kp);                   \
        }                                                                                                          \
        store_block_bf16(acc, MB, b, y, N, n0);                                                                    \
    }
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6) BLOCK(7) BLOCK(8)
BLOCK(9) BLOCK(10) BLOCK(11) BLOCK(12) BLOCK(13) BLOCK(14) BLOCK(15) BLOCK(16)

/* One pass of up to ROWS input rows: PREFIX##_1 .. PREFIX##_8, the kernels for 1 .. 8 rows, on the same arguments */
#define ROW_PASS(PREFIX, rows, ...)                                                                                \
    switch (rows) {                                                                                                \
    case 1: PREFIX##_1(__VA_ARGS__); break;                                                                        \
    case 2: PREFIX##_2(__VA_ARGS__); break;                                                                        \
    case 3: PREFIX##_3(__VA_ARGS__); break;                                                                        \
    case 4: PREFIX##_4(__VA_ARGS__); break;                                                                        \
    case 5: PREFIX##_5(__VA_ARGS__); break;                                                                        \
    case 6: PREFIX##_6(__VA_ARGS__); break;                                                                        \
    case 7: PREFIX##_7(__VA_ARGS__); break;                                                                        \
    default: PREFIX##_8(__VA_ARGS__);                                                                              \
    }

/* One pass of up to 16 input rows, where PREFIX##_9 .. PREFIX##_16 exist (bf16) */
#define WIDE_PASS(PREFIX, rows, ...)                                                                               \
    switch (rows) {                                                                                                \
    case 9: PREFIX##_9(__VA_ARGS__); break;                                                                        \
    case 10: PREFIX##_10(__VA_ARGS__); break;                                                                      \
    case 11: PREFIX##_11(__VA_ARGS__); break;                                                                      \
    case 12: PREFIX##_12(__VA_ARGS__); break;                                                                      \
    case 13: PREFIX##_13(__VA_ARGS__); break;                                                                      \
    case 14: PREFIX##_14(__VA_ARGS__); break;                                                                      \
    case 15: PREFIX##_15(__VA_ARGS__); break;                                                                      \
    case 16: PREFIX##_16(__VA_ARGS__); break;                                                                      \
    default: ROW_PASS(PREFIX, rows, __VA_ARGS__)                                                                   \
    }

/* The product over column blocks (split across threads) and passes (PASS) of up to WIDE input rows where M <=
 * WIDE_UPTO, else ROWS; p: [ceil(N/16), K * 16] weights packed by cpu_kernels.py; b float32 or NULL. One row goes to
 * PREFIX##_row where that takes it (returns 1).
 * Every output is its column's products summed in k order, then the bias: a row's result does not depend on M or the
 * thread count. */
#define GEMV(NAME, TYPE, PREFIX, PASS, WIDE)                                                                     \
    void NAME(const TYPE *x, const TYPE *p, const float *b, TYPE *y, long M, long N, long K, int threads) {        \
        int blocks = (N + 15) / 16;                                                                                \
        if (M == 1 && PREFIX##_row(x, p, b, y, N, K, threads))                                                     \
            return;                                                                                                \
        long step = M <= WIDE_UPTO ? WIDE : ROWS;                                                                  \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                          \
        for (int nb = 0; nb < blocks; nb++) {                                                                      \
            const TYPE *pb = p + (long)nb * 16 * K;                                                                \
            for (long m = 0; m < M; m += step)                                                                     \
                PASS(PREFIX, M - m < step ? M - m : step, x + m * K, pb, b, y + m * N, N, K, nb * 16)              \
        }                                                                                                          \
    }

/* One input row: column blocks i and i + half at once, so each thread streams two distant parts of the weights (two
 * streams for the hardware prefetchers, two accumulator chains); each block's sum is block_1's, op for op. Measured on
 * cold smollm2 products, 2 threads: 3,072 x 576 +5-10% (e.g. 30.6 against 28.5 GB/s beside a 33 GB/s probe), 49,152 x
 * 576 +0-5%; in the engine, the AR step's layers +4.8% (9.22 against 9.66 s over 1,024 alternated calls) */
static inline __attribute__((always_inline)) void block_two(const uint16_t *x, const uint16_t *pa, const uint16_t *pb,
                                                            const float *b, uint16_t *y, int N, int K, int na, int nb) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int kp = 0; kp < K / 2; kp++) {
        int32_t pair;
        __builtin_memcpy(&pair, x + 2 * kp, 4);
        __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(pa + kp * 32), xv);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(pb + kp * 32), xv);
    }
    store_block_bf16(&a0, 1, b, y, N, na);
    store_block_bf16(&a1, 1, b, y, N, nb);
}

/* one row of gemv_bf16: column blocks i and i + half (block_two), split across threads */
static int block_row(const uint16_t *x, const uint16_t *p, const float *b, uint16_t *y, long N, long K, int threads) {
    int blocks = (N + 15) / 16, half = (blocks + 1) / 2;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int i = 0; i < half; i++) {
        int j = i + half;
        if (j < blocks) block_two(x, p + (long)i * 16 * K, p + (long)j * 16 * K, b, y, N, K, i * 16, j * 16);
        else block_1(x, p + (long)i * 16 * K, b, y, N, K, i * 16);
    }
    return 1;
}

/* y[M, N] = x[M, K] W^T (+ b[N]); x, y bfloat16 (as uint16), W packed as above (K even), each column's pairs in order,
 * rounded to bf16 once */
GEMV(gemv_bf16, uint16_t, block, WIDE_PASS, 16)

/* float32 weights packed as [ceil(N/16), K, 16]: input k's weights for a block's 16 output columns are one 64-byte
 * load, multiplied into all rows' accumulators against a broadcast x[m, k] (fused multiply-add, k in order). */
#define BLOCK32(MB)                                                                                                \
    static inline __attribute__((always_inline)) void block32_##MB(const float *x, const float *pb, const float *b, \
                                                                   float *y, int N, int K, int n0) {               \
        __m512 acc[MB];                                                                                            \
        for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();                                                 \
        for (int k = 0; k < K; k++) {                                                                              \
            if (MB > 1) _mm_prefetch((const char *)(pb + k * 16) + PREFETCH, _MM_HINT_T0);                         \
            __m512 w = _mm512_loadu_ps(pb + k * 16);                                                               \
            for (int m = 0; m < MB; m++) acc[m] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[(long)m * K + k]), acc[m]);  \
        }                                                                                                          \
        __mmask16 live = N - n0 >= 16 ? 0xffff : (1u << (N - n0)) - 1;                                             \
        for (int m = 0; m < MB; m++) {                                                                             \
            __m512 r = b ? _mm512_add_ps(acc[m], _mm512_maskz_loadu_ps(live, b + n0)) : acc[m];                    \
            _mm512_mask_storeu_ps(y + (long)m * N + n0, live, r);                                                  \
        }                                                                                                          \
    }
BLOCK32(1) BLOCK32(2) BLOCK32(3) BLOCK32(4) BLOCK32(5) BLOCK32(6) BLOCK32(7) BLOCK32(8)

/* float32 keeps one row in the passes below (two streams not measured for it) */
static inline int block32_row(const float *x, const float *p, const float *b, float *y, long N, long K, int threads) {
    return 0;
}

/* y[M, N] = x[M, K] W^T (+ b[N]) in float32, W packed as above, each column's products fused-added in k order */
GEMV(gemv_f32, float, block32, ROW_PASS, ROWS)

/* exp of 16 floats: Cephes' expf polynomial after range reduction, scaled by 2^n (max relative error ~2 float32 ulp) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* out rows r0 .. r0+used of one KV head, columns [d0, d0 + nd): each row's sum over keys (in order) of its probability
 * (row l's at key s: sc[s * ss + l * ls]) times the value, times inv; 4 rows a pass so a value row is loaded once for
 * 4 rows. tot NULL: inv holds 1 / each row's total; else each row's total is summed here, in key order as softmax_lanes
 * and softmax_key_rows sum it (the same numbers), stored to tot and used. One body per storage type (bf16 values and
 * outputs converted to float32 and rounded back once; float32 as is). */
#define WEIGHTED_VALUES(NAME, TYPE, LOAD, STORE)                                                                    \
    static inline __attribute__((always_inline)) void NAME##_pass(const float *sc, const TYPE *vh, TYPE *out,      \
        const float *inv, long r0, long G, long Hq, long kvh, long S, const long D, long ss, long ls, long l0,      \
        const long n, const long d0, const long nd, float *tot) {                                                  \
        __m512 o[4][16]; /* [row][nd / 16] */                                                                      \
        float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};                                                                     \
        for (long l = 0; l < n; l++)                                                                               \
            for (long d = 0; d < nd / 16; d++) o[l][d] = _mm512_setzero_ps();                                      \
        for (long s = 0; s < S; s++) {                                                                             \
            const float *pr = sc + s * ss + l0 * ls;                                                               \
            int zero = 1;                                                                                          \
            for (long l = 0; l < n; l++) zero &= pr[l * ls] == 0.0f;                                               \
            if (tot != NULL)                                                                                       \
                for (long l = 0; l < n; l++) t[l] += pr[l * ls];                                                   \
            if (zero) continue;                                                                                    \
            for (long d = 0; d < nd / 16; d++) {                                                                   \
                __m512 vv = LOAD(vh + s * D + d0 + d * 16);                                                        \
                for (long l = 0; l < n; l++) o[l][d] = _mm512_fmadd_ps(_mm512_set1_ps(pr[l * ls]), vv, o[l][d]);   \
            }                                                                                                      \
        }                                                                                                          \
        for (long l = 0; l < n; l++) {                                                                             \
            long r = r0 + l0 + l, th = r / G, h = kvh * G + r % G;                                                 \
            float scale = tot != NULL ? 1.0f / (tot[l0 + l] = t[l]) : inv[l0 + l];                                 \
            for (long d = 0; d < nd / 16; d++)                                                                     \
                STORE(out + (th * Hq + h) * D + d0 + d * 16, _mm512_mul_ps(o[l][d], _mm512_set1_ps(scale)));      \
        }                                                                                                          \
    }                                                                                                              \
    static inline __attribute__((always_inline)) void NAME(const float *sc, const TYPE *vh, TYPE *out,             \
        const float *inv, long used, long r0, long G, long Hq, long kvh, long S, const long D, long ss, long ls,    \
        const long d0, const long nd, float *tot) {                                                                \
        for (long l0 = 0; l0 < used; l0 += 4) /* a pass's row count a constant: its sums stay in registers */      \
            switch (used - l0) {                                                                                   \
            case 1: NAME##_pass(sc, vh, out, inv, r0, G, Hq, kvh, S, D, ss, ls, l0, 1, d0, nd, tot); break;        \
            case 2: NAME##_pass(sc, vh, out, inv, r0, G, Hq, kvh, S, D, ss, ls, l0, 2, d0, nd, tot); break;        \
            case 3: NAME##_pass(sc, vh, out, inv, r0, G, Hq, kvh, S, D, ss, ls, l0, 3, d0, nd, tot); break;        \
            default: NAME##_pass(sc, vh, out, inv, r0, G, Hq, kvh, S, D, ss, ls, l0, 4, d0, nd, tot);              \
            }                                                                                                      \
    }
/* unmasked loads and stores: the layers' load16/store16 with a full mask here made 8-row attention 1.4x slower (gcc
 * keeps the masked forms in this inner loop; 109 -> 155 us bf16, 131 -> 192 us float32, 1,000 keys) */
static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)p));
}
static inline void store_bf16x16(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v)); }
WEIGHTED_VALUES(weighted_values_bf16, uint16_t, load_bf16x16, store_bf16x16)
WEIGHTED_VALUES(weighted_values_f32, float, _mm512_loadu_ps, _mm512_storeu_ps)

/* per new slot j of a block: the lanes (rows r0 + l, l < used) whose query row sees it (mask NULL: T == 1) */
static inline void lanes_seeing_new(const uint8_t *mask, long T, long G, long r0, long used, __mmask16 *sees_new) {
    for (long j = 0; j < T; j++) {
        sees_new[j] = 0;
        for (long l = 0; l < used; l++)
            if (mask == NULL || mask[((r0 + l) / G) * T + j]) sees_new[j] |= (__mmask16)(1u << l);
    }
}

/* key s's 16 scores (one per lane), scaled and masked, stored to sc; returns the running max */
static inline __m512 keep_score(float *sc, long s, long start, const __mmask16 *sees_new, __m512 acc, float scale,
                                __m512 top) {
    __m512 x = _mm512_mul_ps(acc, _mm512_set1_ps(scale));
    if (s >= start) x = _mm512_mask_blend_ps(sees_new[s - start], _mm512_set1_ps(-INFINITY), x);
    _mm512_storeu_ps(sc + s * 16, x);
    return _mm512_max_ps(top, x);
}

/* softmax across keys per lane, in place (unseen keys -> 0, summed in key order); inv: 1 / each lane's total */
static inline void softmax_lanes(float *sc, long S, __m512 top, float *inv) {
    __m512 total = _mm512_setzero_ps();
    for (long s = 0; s < S; s++) {
        __m512 x = _mm512_loadu_ps(sc + s * 16);
        __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, top)));
        _mm512_storeu_ps(sc + s * 16, e);
        total = _mm512_add_ps(total, e);
    }
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
}

/* One block's scores, 16 query rows (lanes) against the keys s_lo <= s < S, scaled and masked into sc; returns the
 * lanes' max. bf16: the queries packed as pairs (the layout of gemv_bf16), a key's 16 scores one vdpbf16ps chain over
 * its broadcast pairs; float32: the queries lane-major per dimension, one fused multiply-add chain over d in order.
 * KEYS keys' chains run side by side so each chain's latency is hidden; each lane's sum is in one order. */
static inline __m512 scores_bf16(const uint16_t *q, const uint16_t *kh, long r0, long used, long G, long Hq, long kvh,
                                 long D, long s_lo, long S, long start, const __mmask16 *sees_new, float scale,
                                 float *sc) {
    uint32_t qp[128 * 16];  /* [D/2, 16] bf16 pairs of the block's queries; lane l = row r0 + l = (t, g) */
    for (long l = 0; l < 16; l++) {
        long r = r0 + l, t = r / G, h = kvh * G + r % G;
        for (long dp = 0; dp < D / 2; dp++) qp[dp * 16 + l] = l < used ? ((const uint32_t *)(q + (t * Hq + h) * D))[dp] : 0;
    }
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (long s0 = s_lo; s0 < S; s0 += KEYS) {
        long nk = S - s0 < KEYS ? S - s0 : KEYS;
        __m512 acc[KEYS];
        for (long j = 0; j < KEYS; j++) acc[j] = _mm512_setzero_ps();
        for (long dp = 0; dp < D / 2; dp++) {
            __m512bh qv = (__m512bh)_mm512_loadu_si512(qp + dp * 16);
            for (long j = 0; j < KEYS; j++)
                if (j < nk) acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_set1_epi32(
                    ((const uint32_t *)(kh + (s0 + j) * D))[dp]));
        }
        for (long j = 0; j < nk; j++) top = keep_score(sc, s0 + j, start, sees_new, acc[j], scale, top);
    }
    return top;
}

static inline __m512 scores_f32(const float *q, const float *kh, long r0, long used, long G, long Hq, long kvh, long D,
                                long s_lo, long S, long start, const __mmask16 *sees_new, float scale, float *sc) {
    float qf[256 * 16];  /* [D, 16]: lane l = row r0 + l = (t, g) */
    for (long l = 0; l < 16; l++) {
        long r = r0 + l, t = r / G, h = kvh * G + r % G;
        for (long d = 0; d < D; d++) qf[d * 16 + l] = l < used ? q[(t * Hq + h) * D + d] : 0.0f;
    }
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (long s0 = s_lo; s0 < S; s0 += KEYS) {
        long nk = S - s0 < KEYS ? S - s0 : KEYS;
        __m512 acc[KEYS];
        for (long j = 0; j < KEYS; j++) acc[j] = _mm512_setzero_ps();
        for (long d = 0; d < D; d++) {
            __m512 qv = _mm512_loadu_ps(qf + d * 16);
            for (long j = 0; j < KEYS; j++)
                if (j < nk) acc[j] = _mm512_fmadd_ps(qv, _mm512_set1_ps(kh[(s0 + j) * D + d]), acc[j]);
        }
        for (long j = 0; j < nk; j++) top = keep_score(sc, s0 + j, start, sees_new, acc[j], scale, top);
    }
    return top;
}

static inline __mmask16 tail(long n, long i) { return n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1); }

/* ---- keys in lanes: the path for blocks of few query rows (AR: G rows a KV head, 3 of 16 lanes busy above) ----
 * The same numbers as the queries-in-lanes path, bit for bit: a lane's vdpbf16ps (or fused multiply-add) chain over d
 * in order is the same whichever operand is broadcast, max is exact, each row's total is summed in key order, and the
 * values pass is the same. Keys are transposed in registers 16 at a time; row l's scores go to sc[l * S + s].
 * Measured with the values pass's row count a constant, 2,048 keys, hot, one thread: 3 rows 28 against 55 us, 6 rows 45
 * against 61; 30 cold layers, 2 threads, 3 rows: 4.0 against 5.0 ms. Beyond 8 rows a full block of 16 lanes wins. */
#define KIL_ROWS 8  /* rows a block at most on this path */

/* 16 x 16 32-bit elements transposed in registers: lane j of r[i] becomes lane i of r[j] */
static inline void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: element c of rows 4i .. 4i+3 in r[4i + c] */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {  /* then the 4 x 4 transpose of 128-bit lanes */
        t[c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
        t[8 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
        r[4 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0xdd);
    }
}

/* row l's 16 scores of keys s0 .. s0+15 (lanes past S unused): scaled, unseen new keys -> -inf (keep_score's), stored
 * to its row of sc; its running max updated */
static inline void keep_scores_row(float *scl, long s0, long S, long start, const __mmask16 *sees_new, long l,
                                   __m512 acc, float scale, __m512 *top) {
    __m512 x = _mm512_mul_ps(acc, _mm512_set1_ps(scale));
    __mmask16 live = tail(S, s0), unseen = 0;
    for (long j = s0 < start ? start - s0 : 0; j < 16 && s0 + j < S; j++)
        if (!((sees_new[s0 + j - start] >> l) & 1)) unseen |= (__mmask16)(1u << j);
    x = _mm512_mask_blend_ps(unseen, x, _mm512_set1_ps(-INFINITY));
    _mm512_mask_storeu_ps(scl + s0, live, x);
    *top = _mm512_mask_max_ps(*top, live, *top, x);
}

/* KEY_ROWS(NAME, TYPE, W, DOT): rows r0 .. r0+used of KV head kvh against every key, keys in lanes; W elements of TYPE
 * per 32-bit transposed element (bf16: a pair, as vdpbf16ps takes them; float32: one); top[l]: row l's max */
#define KEY_ROWS(NAME, TYPE, W, DOT)                                                                               \
    static inline __attribute__((always_inline)) void NAME##_n(const TYPE *q, const TYPE *kh, long r0,             \
        const long used, long G, long Hq, long kvh, long D, long s_lo, long S, long stride, long start,      \
        const __mmask16 *sees_new,         \
        float scale, float *sc, float *top) {                                                                      \
        const uint32_t *qr[KIL_ROWS];                                                                              \
        __m512 tops[KIL_ROWS];                                                                                     \
        for (long l = 0; l < used; l++) {                                                                          \
            long r = r0 + l, t = r / G, h = kvh * G + r % G;                                                       \
            qr[l] = (const uint32_t *)(q + (t * Hq + h) * D);                                                      \
            tops[l] = _mm512_set1_ps(-INFINITY);                                                                   \
        }                                                                                                          \
        for (long s0 = s_lo; s0 < S; s0 += 16) {                                                                   \
            long nk = S - s0 < 16 ? S - s0 : 16;                                                                   \
            __m512 acc[KIL_ROWS];                                                                                  \
            for (long l = 0; l < used; l++) acc[l] = _mm512_setzero_ps();                                          \
            for (long c = 0; c < D / (16 * W); c++) {                                                              \
                __m512i r[16];                                                                                     \
                for (long j = 0; j < 16; j++)                                                                      \
                    r[j] = j < nk ? _mm512_loadu_si512(kh + (s0 + j) * D + c * 16 * W) : _mm512_setzero_si512();   \
                transpose16(r);                                                                                    \
                for (long e = 0; e < 16; e++)                                                                      \
                    for (long l = 0; l < used; l++) acc[l] = DOT(acc[l], r[e], qr[l][c * 16 + e]);                 \
            }                                                                                                      \
            for (long l = 0; l < used; l++)                                                                        \
                keep_scores_row(sc + l * stride, s0, S, start, sees_new, l, acc[l], scale, &tops[l]);              \
        }                                                                                                          \
        for (long l = 0; l < used; l++) top[l] = _mm512_reduce_max_ps(tops[l]);                                   \
    }                                                                                                              \
    /* one body per row count, so the rows' accumulators stay in registers */                                      \
    static void NAME(const TYPE *q, const TYPE *kh, long r0, long used, long G, long Hq, long kvh, long D, long s_lo, \
                     long S, long stride, long start, const __mmask16 *sees_new, float scale, float *sc, float *top) {\
        switch (used) {                                                                                            \
        case 1: NAME##_n(q, kh, r0, 1, G, Hq, kvh, D, s_lo, S, stride, start, sees_new, scale, sc, top); break;    \
        case 2: NAME##_n(q, kh, r0, 2, G, Hq, kvh, D, s_lo, S, stride, start, sees_new, scale, sc, top); break;    \
        case 3: NAME##_n(q, kh, r0, 3, G, Hq, kvh, D, s_lo, S, stride, start, sees_new, scale, sc, top); break;    \
        case 4: NAME##_n(q, kh, r0, 4, G, Hq, kvh, D, s_lo, S, stride, start, sees_new, scale, sc, top); break;    \
        case 5: NAME##_n(q, kh, r0, 5, G, Hq, kvh, D, s_lo, S, stride, start, sees_new, scale, sc, top); break;    \
        case 6: NAME##_n(q, kh, r0, 6, G, Hq, kvh, D, s_lo, S, stride, start, sees_new, scale, sc, top); break;    \
        case 7: NAME##_n(q, kh, r0, 7, G, Hq, kvh, D, s_lo, S, stride, start, sees_new, scale, sc, top); break;    \
        default: NAME##_n(q, kh, r0, 8, G, Hq, kvh, D, s_lo, S, stride, start, sees_new, scale, sc, top);          \
        }                                                                                                          \
    }
static inline __m512 dot_pair_bf16(__m512 acc, __m512i k, uint32_t q) {
    return _mm512_dpbf16_ps(acc, (__m512bh)k, (__m512bh)_mm512_set1_epi32(q));
}
static inline __m512 dot_f32(__m512 acc, __m512i k, uint32_t q) {
    float f;
    __builtin_memcpy(&f, &q, 4);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(k), _mm512_set1_ps(f), acc);
}
KEY_ROWS(key_rows_bf16, uint16_t, 2, dot_pair_bf16)
KEY_ROWS(key_rows_f32, float, 1, dot_f32)

/* softmax of each row in place (softmax_lanes' numbers: exp per key, unseen keys -> 0, each row's total summed in key
 * order, 4 rows side by side); inv[l]: 1 / row l's total */
static inline void softmax_key_rows(float *sc, long S, long used, const float *top, float *inv) {
    for (long l = 0; l < used; l++)
        for (long s0 = 0; s0 < S; s0 += 16) {
            __mmask16 m = tail(S, s0);
            __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, sc + l * S + s0);
            __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, _mm512_set1_ps(top[l]))));
            _mm512_mask_storeu_ps(sc + l * S + s0, m, e);
        }
    for (long l0 = 0; l0 < used; l0 += 4) {
        float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
        const float *e = sc + l0 * S;
        long n = used - l0 < 4 ? used - l0 : 4;
        for (long s = 0; s < S; s++) {
            t0 += e[s];
            if (n > 1) t1 += e[S + s];
            if (n > 2) t2 += e[2 * S + s];
            if (n > 3) t3 += e[3 * S + s];
        }
        float t[4] = {t0, t1, t2, t3};
        for (long j = 0; j < n; j++) inv[l0 + j] = 1.0f / t[j];
    }
}

/* Attention of T new query rows over a head-major KV cache whose slots [0, start + T) hold the prefix and the new
 * tokens: row t sees every prefix slot and the new slots j with mask[t, j] (mask NULL: T == 1, the row sees itself).
 *
 * Per KV head, its G * T query rows (t, g) go 16 to a block, one per lane: the block's scores (SCORES, no horizontal
 * sums), softmax in float32 across keys per lane, then each row's weighted sum of values (VALUES). Each lane does the
 * same operations in the same order whatever shares its block. A block of at most KIL_ROWS rows takes the keys-in-lanes
 * path (KEY_ROWS_FN, softmax_key_rows), which gives each row the same numbers bit for bit.
 *
 * Blocks are the threads' items. Where they do not divide among the threads and the keys are many (an AR step: 3
 * blocks on 2 threads left one thread reading twice the cache), NAME##_split shares each block between threads
 * without changing a number: the scores and their exponentials a chunk of keys each (every score computed alone;
 * the max is exact in any order), then the values a pass of 4 rows or a slice of columns each, every row's total and
 * weighted sum still taken over the keys in order. (A NaN score, which only a broken model gives, restarts the
 * running max where it falls: there the split's maxima, and so the output's last bits, can differ.)
 *
 * q, out: [T, Hq, D]; k, v: [Hkv, cap, D] (TYPE: bf16 as uint16, or float); mask: [T, T] bytes or NULL; scratch:
 * Hkv * ceil(G*T/16) * (start + T) * 16 float32. D % 32 == 0, D <= 256, Hq % Hkv == 0. */
#define SPLIT_KEYS 1024  /* keys from which blocks are shared between threads */

/* exp(score - the row's max) in place for keys [s_lo, S) of one block (unseen keys -> 0): softmax_lanes' and
 * softmax_key_rows' numbers. Keys in lanes (ls > 1): row l's scores at sc + l * ls, tops[l] its max; else 16 lanes a
 * key, top the lanes' max. */
static inline void exp_keys(float *sc, long s_lo, long S, long used, long ls, const float *tops, __m512 top) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    if (ls > 1) {
        for (long l = 0; l < used; l++)
            for (long s0 = s_lo; s0 < S; s0 += 16) {
                __mmask16 m = tail(S, s0);
                __m512 x = _mm512_mask_loadu_ps(ninf, m, sc + l * ls + s0);
                __mmask16 seen = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
                __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, _mm512_set1_ps(tops[l]))));
                _mm512_mask_storeu_ps(sc + l * ls + s0, m, e);
            }
        return;
    }
    for (long s = s_lo; s < S; s++) {
        __m512 x = _mm512_loadu_ps(sc + s * 16);
        __mmask16 seen = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
        _mm512_storeu_ps(sc + s * 16, _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, top))));
    }
}

/* VALUES##_pass over rows l0 .. l0 + n (n <= 4) and columns [d0, d0 + nd), each row's total summed there (tot: the
 * block's totals); D and nd constants where they are common, so the sums stay in registers */
#define VALUES_PART(PASS, sc, vh, out, r0, G, Hq, kvh, S, D, ss, ls, l0, n, d0, nd, tot)                          \
    switch (n * 1000 + (D == 64 && nd == 64 ? 1 : D == 128 && nd == 128 ? 2 : D == 128 && nd == 64 ? 3 : 0)) {    \
    case 1001: PASS(sc, vh, out, NULL, r0, G, Hq, kvh, S, 64, ss, ls, l0, 1, 0, 64, tot); break;                 \
    case 2001: PASS(sc, vh, out, NULL, r0, G, Hq, kvh, S, 64, ss, ls, l0, 2, 0, 64, tot); break;                 \
    case 3001: PASS(sc, vh, out, NULL, r0, G, Hq, kvh, S, 64, ss, ls, l0, 3, 0, 64, tot); break;                 \
    case 4001: PASS(sc, vh, out, NULL, r0, G, Hq, kvh, S, 64, ss, ls, l0, 4, 0, 64, tot); break;                 \
    case 1002: PASS(sc, vh, out, NULL, r0, G, Hq, kvh, S, 128, ss, ls, l0, 1, 0, 128, tot); break;               \
    case 2002: PASS(sc, vh, out, NULL, r0, G, Hq, kvh, S, 128, ss, ls, l0, 2, 0, 128, tot); break;               \
    case 3002: PASS(sc, vh, out, NULL, r0, G, Hq, kvh, S, 128, ss, ls, l0, 3, 0, 128, tot); break;               \
    case 4002: PASS(sc, vh, out, NULL, r0, G, Hq, kvh, S, 128, ss, ls, l0, 4, 0, 128, tot); break;               \
    case 1003: PASS(sc, vh, out, NULL, r0, G, Hq, kvh, S, 128, ss, ls, l0, 1, d0, 64, tot); break;               \
    case 2003: PASS(sc, vh, out, NULL, r0, G, Hq, kvh, S, 128, ss, ls, l0, 2, d0, 64, tot); break;               \
    case 3003: PASS(sc, vh, out, NULL, r0, G, Hq, kvh, S, 128, ss, ls, l0, 3, d0, 64, tot); break;               \
    case 4003: PASS(sc, vh, out, NULL, r0, G, Hq, kvh, S, 128, ss, ls, l0, 4, d0, 64, tot); break;               \
    default: PASS(sc, vh, out, NULL, r0, G, Hq, kvh, S, D, ss, ls, l0, n, d0, nd, tot);                          \
    }

#define ATTEND(NAME, TYPE, SCORES, KEY_ROWS_FN, VALUES)                                                              \
    static int NAME##_split(const TYPE *q, const TYPE *k, const TYPE *v, long cap, const uint8_t *mask, TYPE *out,   \
                            long T, long Hq, long Hkv, long D, long start, float scale, float *scratch,              \
                            int threads) {                                                                           \
        long S = start + T, G = Hq / Hkv, rows = G * T, blocks = (rows + 15) / 16, items = Hkv * blocks;            \
        long per = ((S + threads - 1) / threads + 15) / 16 * 16, chunks = (S + per - 1) / per;                       \
        long parts = 1; /* column slices of whole 128-byte pairs of cache lines (a line alone: its pair is fetched \
                         * beside it), at most one a thread */                                                      \
        while (parts * 2 <= threads && (long)sizeof(TYPE) * D / (parts * 2) >= 128 && D % (parts * 32) == 0)        \
            parts *= 2;                                                                                             \
        float *tops = malloc(sizeof(float) * 16 * items * chunks + sizeof(long) * 4 * items);                        \
        if (tops == NULL)                                                                                           \
            return -1;                                                                                              \
        long *passes = (long *)(tops + 16 * items * chunks), units = 0; /* item * 4 + pass of 4 rows, in order */   \
        for (long item = 0; item < items; item++)                                                                   \
            for (long l0 = 0; l0 < 16 && l0 < rows - (item % blocks) * 16; l0 += 4)                                \
                passes[units++] = item * 4 + l0 / 4;                                                                \
        _Pragma("omp parallel num_threads(threads)")                                                               \
        {                                                                                                           \
            _Pragma("omp for schedule(static)")                                                                    \
            for (long it = 0; it < items * chunks; it++) {                                                          \
                long item = it / chunks, s_lo = (it % chunks) * per, s_hi = s_lo + per < S ? s_lo + per : S;        \
                long kvh = item / blocks, r0 = (item % blocks) * 16, used = rows - r0 < 16 ? rows - r0 : 16;        \
                __mmask16 sees_new[T];                                                                              \
                lanes_seeing_new(mask, T, G, r0, used, sees_new);                                                   \
                float *sc = scratch + item * S * 16;                                                                \
                _mm512_storeu_ps(tops + it * 16, _mm512_set1_ps(-INFINITY));                                        \
                if (used <= KIL_ROWS)                                                                               \
                    KEY_ROWS_FN(q, k + kvh * cap * D, r0, used, G, Hq, kvh, D, s_lo, s_hi, S, start, sees_new,       \
                                scale, sc, tops + it * 16);                                                         \
                else                                                                                                \
                    _mm512_storeu_ps(tops + it * 16, SCORES(q, k + kvh * cap * D, r0, used, G, Hq, kvh, D, s_lo,    \
                                                            s_hi, start, sees_new, scale, sc));                    \
            }                                                                                                       \
            _Pragma("omp for schedule(static)")                                                                    \
            for (long it = 0; it < items * chunks; it++) {                                                          \
                long item = it / chunks, s_lo = (it % chunks) * per, s_hi = s_lo + per < S ? s_lo + per : S;        \
                long r0 = (item % blocks) * 16, used = rows - r0 < 16 ? rows - r0 : 16;                             \
                __m512 top = _mm512_loadu_ps(tops + item * chunks * 16);                                            \
                for (long c = 1; c < chunks; c++)                                                                   \
                    top = _mm512_max_ps(top, _mm512_loadu_ps(tops + (item * chunks + c) * 16));                     \
                float rtop[16];                                                                                     \
                _mm512_storeu_ps(rtop, top);                                                                        \
                exp_keys(scratch + item * S * 16, s_lo, s_hi, used, used <= KIL_ROWS ? S : 1, rtop, top);           \
            }                                                                                                       \
            _Pragma("omp for schedule(static)") /* a block's passes of 4 rows and column slices: one unit each */   \
            for (long it = 0; it < units * parts; it++) {                                                           \
                long item = passes[it / parts] / 4, l0 = passes[it / parts] % 4 * 4;                                \
                long kvh = item / blocks, r0 = (item % blocks) * 16;                                                \
                long used = rows - r0 < 16 ? rows - r0 : 16, nd = D / parts, d0 = (it % parts) * nd;                \
                long ss = used <= KIL_ROWS ? 1 : 16, ls = used <= KIL_ROWS ? S : 1, n = used - l0 < 4 ? used - l0 : 4; \
                float tot[16];                                                                                      \
                VALUES_PART(VALUES##_pass, scratch + item * S * 16, v + kvh * cap * D, out, r0, G, Hq, kvh, S, D,   \
                            ss, ls, l0, n, d0, nd, tot)                                                             \
            }                                                                                                       \
        }                                                                                                           \
        free(tops);                                                                                                 \
        return 0;                                                                                                   \
    }                                                                                                               \
    /* block item (KV head item / blocks, rows from (item % blocks) * 16) of T rows over [0, start + T) keys;        \
     * sc: its scores' scratch, (start + T) * 16 floats */                                                           \
    static inline void NAME##_block(const TYPE *q, const TYPE *k, const TYPE *v, long cap, const uint8_t *mask,      \
                                    TYPE *out, long T, long Hq, long Hkv, long D, long start, float scale,           \
                                    long item, long blocks, float *sc) {                                             \
        long S = start + T, G = Hq / Hkv, rows = G * T;                                                              \
        long kvh = item / blocks, r0 = (item % blocks) * 16, used = rows - r0 < 16 ? rows - r0 : 16;                 \
        const TYPE *kh = k + kvh * cap * D, *vh = v + kvh * cap * D;                                                 \
        __mmask16 sees_new[T];                                                                                       \
        lanes_seeing_new(mask, T, G, r0, used, sees_new);                                                            \
        float inv[16];                                                                                               \
        long ss = 16, ls = 1; /* where row l's probability of key s is: sc[s * ss + l * ls] */                       \
        if (used <= KIL_ROWS) {                                                                                      \
            float top[KIL_ROWS];                                                                                     \
            KEY_ROWS_FN(q, kh, r0, used, G, Hq, kvh, D, 0, S, S, start, sees_new, scale, sc, top);                   \
            softmax_key_rows(sc, S, used, top, inv);                                                                 \
            ss = 1, ls = S;                                                                                          \
        } else {                                                                                                     \
            __m512 top = SCORES(q, kh, r0, used, G, Hq, kvh, D, 0, S, start, sees_new, scale, sc);                   \
            softmax_lanes(sc, S, top, inv);                                                                          \
        }                                                                                                            \
        if (D == 64) VALUES(sc, vh, out, inv, used, r0, G, Hq, kvh, S, 64, ss, ls, 0, 64, NULL); /* registers */     \
        else if (D == 128) VALUES(sc, vh, out, inv, used, r0, G, Hq, kvh, S, 128, ss, ls, 0, 128, NULL);             \
        else VALUES(sc, vh, out, inv, used, r0, G, Hq, kvh, S, D, ss, ls, 0, D, NULL);                               \
    }                                                                                                                \
    void NAME(const TYPE *q, const TYPE *k, const TYPE *v, long cap, const uint8_t *mask, TYPE *out, long T,         \
              long Hq, long Hkv, long D, long start, float scale, float *scratch, int threads) {                     \
        long S = start + T, G = Hq / Hkv, rows = G * T, blocks = (rows + 15) / 16;                                   \
        if (threads > 1 && S >= SPLIT_KEYS && (Hkv * blocks) % threads != 0                                          \
            && NAME##_split(q, k, v, cap, mask, out, T, Hq, Hkv, D, start, scale, scratch, threads) == 0)            \
            return; /* else unsplit (no memory for the split's maxima) */                                            \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                            \
        for (long item = 0; item < Hkv * blocks; item++)                                                             \
            NAME##_block(q, k, v, cap, mask, out, T, Hq, Hkv, D, start, scale, item, blocks, scratch + item * S * 16);\
    }
ATTEND(attend_bf16, uint16_t, scores_bf16, key_rows_bf16, weighted_values_bf16)
ATTEND(attend_f32, float, scores_f32, key_rows_f32, weighted_values_f32)

/* softmax of one row's S scores in place (keys in lanes: unseen keys -> 0, summed 16 keys side by side, then
 * across lanes); returns 1 / the total */
static inline float softmax_row(float *x, long S, float top) {
    __m512 total = _mm512_setzero_ps();
    for (long s = 0; s < S; s += 16) {
        __mmask16 m = tail(S, s);
        __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, x + s);
        __mmask16 seen = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(v, _mm512_set1_ps(top))));
        _mm512_mask_storeu_ps(x + s, m, e);
        total = _mm512_add_ps(total, e);
    }
    return 1.0f / _mm512_reduce_add_ps(total);
}

/* ---- whole decoder layers (Llama family: RMSNorm, fused QKV, rotate-half RoPE, GQA attention, SiLU-gated MLP) ----
 * Each elementwise step rounds where the torch ops of decoder.py do (bf16: a float32 op, rounded to bf16 once; float32:
 * each op's float32 result), so the results are those of the torch path but for the norm's sum of squares (fused
 * multiply-adds in another order) and the exp in SiLU: a last-bit difference that bf16's rounding mostly absorbs and
 * float32 carries into later values (~3e-6 of a tiny model's largest hidden value). One body per storage type (LAYERS
 * below); bf16 as uint16. */


static inline __m512 load16(const uint16_t *p, __mmask16 m) {
    return _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, p));
}
static inline void store16(uint16_t *p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
static inline __m512 round16(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }  /* to bf16 and back */

static inline __m512 load16_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void store16_f32(float *p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
static inline __m512 round16_f32(__m512 v) { return v; }  /* float32 ops round to float32 by themselves */

/* 4-bit weights (the quantized self-drafter's), w[n][k] = d * q + m with q in 0 .. 15, d and m per column and group
 * of QG inputs: per column block of 16 and group, 256 code bytes, then the block's 16 d and 16 m in float16 (GGUF's
 * scales: 1 bit a weight more, where float32's 2 made the products read ~17% more bytes), m' = m - 128 d computed
 * here. A 32-byte code chunk c covers 4 inputs of the block, pairs 2c and 2c + 1 of the group: byte j's low nibble is
 * element j of pair 2c and its high nibble element j of pair 2c + 1. Element j is column j / 2's input j % 2
 * (gemv_bf16's order). A nibble becomes a bf16 by its bits alone: 0x4300 | n is 128 + n (exact), so a group's sum of
 * (128 + q) x is exact products (vdpbf16ps) summed in float32, and acc += d * that + m' * (the group's sum of x) gives
 * d * sum(q x) + m * sum(x). (A table lookup per nibble, vpermw, was 1.03-1.3x slower on smollm2's shapes.) */
#define QG 32
#define QBYTES (QG * 8 + 2 * 16 * 2)
#define BLOCKQ(MB)                                                                                                     \
    static inline __attribute__((always_inline)) void blockq4_##MB(const uint16_t *x, const uint8_t *pb,               \
                                                                   const float *xs, const float *b, uint16_t *y,       \
                                                                   int N, int K, int n0) {                             \
        const __m512i low = _mm512_set1_epi16(0xf), bits = _mm512_set1_epi16(0x4300);                                  \
        int G = K / QG;                                                                                                \
        __m512 acc[MB];                                                                                                \
        for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();                                                     \
        for (int g = 0; g < G; g++) {                                                                                  \
            const uint8_t *pg = pb + (long)g * QBYTES;                                                                 \
            __m512 part[MB];                                                                                           \
            for (int m = 0; m < MB; m++) part[m] = _mm512_setzero_ps();                                                \
            for (int c = 0; c < QG / 4; c++) {                                                                         \
                if (MB > 1) _mm_prefetch((const char *)(pg + c * 32) + PREFETCH, _MM_HINT_T0);                         \
                __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(pg + c * 32)));                  \
                __m512bh w0 = (__m512bh)_mm512_or_si512(_mm512_and_si512(v, low), bits);                               \
                __m512bh w1 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), bits);                                \
                long k0 = (long)g * QG + c * 4;                                                                        \
                for (int m = 0; m < MB; m++)                                                                           \
                    part[m] = dot_pair(dot_pair(part[m], w0, x + (long)m * K + k0), w1, x + (long)m * K + k0 + 2);     \
            }                                                                                                          \
            const __m256i *dm = (const __m256i *)(pg + QG * 8);                                                        \
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(dm));                                                        \
            __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(dm + 1));                                                   \
            mn = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.0f), mn);                                                      \
            for (int m = 0; m < MB; m++)                                                                               \
                acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[(long)m * G + g]),                                      \
                                         _mm512_fmadd_ps(d, part[m], acc[m]));                                         \
        }                                                                                                              \
        store_block_bf16(acc, MB, b, y, N, n0);                                                                        \
    }
BLOCKQ(1) BLOCKQ(2) BLOCKQ(3) BLOCKQ(4) BLOCKQ(5) BLOCKQ(6) BLOCKQ(7) BLOCKQ(8)

/* y[M, N] = x[M, K] W^T (+ b[N]) for 4-bit W packed as above (K % QG == 0, p: the packed bytes), x and y bfloat16;
 * float32 accumulation, each output's groups summed in order and rounded to bf16 once. xs, each row's sum over each
 * group of its inputs, is computed here, ROWS rows a pass. */
void gemv_q4(const uint16_t *x, const uint16_t *p, const float *b, uint16_t *y, long M, long N, long K, int threads) {
    int blocks = (N + 15) / 16, G = K / QG;
    const uint8_t *q = (const uint8_t *)p;
    for (long m0 = 0; m0 < M; m0 += ROWS) {
        int rows = M - m0 < ROWS ? M - m0 : ROWS;
        float xs[ROWS * G];
        for (int m = 0; m < rows; m++)
            for (int g = 0; g < G; g++) {
                __m512 s = _mm512_add_ps(load16(x + (m0 + m) * K + g * QG, 0xffff),
                                         load16(x + (m0 + m) * K + g * QG + 16, 0xffff));
                xs[m * G + g] = _mm512_reduce_add_ps(s);
            }
        _Pragma("omp parallel for schedule(static) num_threads(threads)")
        for (int nb = 0; nb < blocks; nb++)
            ROW_PASS(blockq4, rows, x + m0 * K, q + (long)nb * G * QBYTES, xs, b, y + m0 * N, N, K, nb * 16)
    }
}

/* acc + w . (the 4 int8 at p, in every lane): vpdpbusd, w's bytes unsigned, p's signed, broadcast as dot_pair's */
static inline __attribute__((always_inline)) __m512i dot_quad(__m512i acc, __m512i w, const int8_t *p) {
    __asm__("vpdpbusd %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*(const pair_t *)p), "v"(w));
    return acc;
}

/* The same 4-bit products with each row's inputs on an int8 grid per group of QG (scale max |x| / 127, codes rounded
 * to nearest even): the code bytes as u8 against the s8 inputs, 4 products a lane (vpdpbusd: a 16-bit word of codes,
 * zero-extended to its lane, holds inputs 4c, 4c + 1 in its low nibbles and 4c + 2, 4c + 3 in its high ones), each
 * group's exact int32 sum scaled once: acc += (d * s) * sum(q c) + (m * s) * sum(c). The minimums take the coded inputs
 * too, so this is the weights times the inputs on their grid and a weight's error enters centred (llama.cpp's Q8_1
 * sums; m times the inputs themselves leaves d * sum(q (x - s c)), q in 0 .. 15: ~2x the error). Half the
 * instructions of gemv_q4 but ~1% error on the inputs: the drafter's coarse LM head (rescoring gives its candidates
 * the model's own logits), not its layers (the drafted tokens it loses there cost what it saves). */
#define BLOCKQ8(MB)                                                                                                    \
    static inline __attribute__((always_inline)) void blockq8_##MB(const int8_t *x, const uint8_t *pb,                \
                                                                   const float *xs, const float *sx, const float *b,   \
                                                                   uint16_t *y, int N, int K, int n0) {                \
        const __m512i low = _mm512_set1_epi32(0x0f0f), high = _mm512_set1_epi32(0x0f0f0000);                          \
        int G = K / QG;                                                                                                \
        __m512 acc[MB];                                                                                                \
        for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();                                                     \
        for (int g = 0; g < G; g++) {                                                                                  \
            const uint8_t *pg = pb + (long)g * QBYTES;                                                                 \
            __m512i part[MB];                                                                                          \
            for (int m = 0; m < MB; m++) part[m] = _mm512_setzero_si512();                                             \
            for (int c = 0; c < QG / 4; c++) {                                                                         \
                if (MB > 1) _mm_prefetch((const char *)(pg + c * 32) + PREFETCH, _MM_HINT_T0);                         \
                __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(pg + c * 32)));                 \
                /* low | (u << 12 & high): lane bytes = inputs 4c .. 4c + 3 */                                         \
                __m512i w = _mm512_ternarylogic_epi32(_mm512_and_si512(u, low), _mm512_slli_epi32(u, 12), high, 0xF8); \
                long k0 = (long)g * QG + c * 4;                                                                        \
                for (int m = 0; m < MB; m++) part[m] = dot_quad(part[m], w, x + (long)m * K + k0);                     \
            }                                                                                                          \
            const __m256i *dm = (const __m256i *)(pg + QG * 8);                                                        \
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(dm));                                                        \
            __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(dm + 1));                                                   \
            for (int m = 0; m < MB; m++) {                                                                             \
                __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(sx[(long)m * G + g]));                                     \
                acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[(long)m * G + g]),                                      \
                                         _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(part[m]), acc[m]));                    \
            }                                                                                                          \
        }                                                                                                              \
        store_block_bf16(acc, MB, b, y, N, n0);                                                                        \
    }
BLOCKQ8(1) BLOCKQ8(2) BLOCKQ8(3) BLOCKQ8(4) BLOCKQ8(5) BLOCKQ8(6) BLOCKQ8(7) BLOCKQ8(8)

/* s: 16 inputs' codes at c (x * inv, to nearest even; |x| <= top codes within +-127); returns the codes' sum */
static inline int q8_inputs(__m512 x, __m512 inv, int8_t *c) {
    __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(x, inv));
    _mm_storeu_si128((__m128i *)c, _mm512_cvtsepi32_epi8(codes));
    return _mm512_reduce_add_epi32(codes);
}

/* gemv_q4's y = x W^T (+ b) through blockq8: each row's inputs coded per group (xq), with the group's scale (sx) and
 * plain sum (xs), ROWS rows a pass; a row's result does not depend on the others. */
void gemv_q4_q8(const uint16_t *x, const uint16_t *p, const float *b, uint16_t *y, long M, long N, long K,
                int threads) {
    int blocks = (N + 15) / 16, G = K / QG;
    const uint8_t *q = (const uint8_t *)p;
    for (long m0 = 0; m0 < M; m0 += ROWS) {
        int rows = M - m0 < ROWS ? M - m0 : ROWS;
        float xs[ROWS * G], sx[ROWS * G];
        int8_t xq[ROWS * K];
        for (int m = 0; m < rows; m++)
            for (int g = 0; g < G; g++) {
                const uint16_t *r = x + (m0 + m) * K + g * QG;
                __m512 a = load16(r, 0xffff), c = load16(r + 16, 0xffff);
                float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
                __m512 inv = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
                sx[m * G + g] = top / 127.0f;
                int codes = q8_inputs(a, inv, xq + m * K + g * QG) + q8_inputs(c, inv, xq + m * K + g * QG + 16);
                xs[m * G + g] = sx[m * G + g] * (float)codes;
            }
        _Pragma("omp parallel for schedule(static) num_threads(threads)")
        for (int nb = 0; nb < blocks; nb++)
            ROW_PASS(blockq8, rows, xq, q + (long)nb * G * QBYTES, xs, sx, b, y + m0 * N, N, K, nb * 16)
    }
}

typedef struct {
    const void *ln1, *ln2;                 /* [H] norm weights, in the layers' type */
    const void *qkv, *o, *gate_up, *down;  /* packed as for the type's gemv: [q; k; v], o, [gate; up], down */
    const float *b_qkv, *b_o, *b_gate_up, *b_down;  /* float32 biases or NULL */
} layer_t;

/* One sequence of a forward: its new tokens are rows [r0, r0 + T) of x, at slots [start, start + T) of its cache, whose
 * layer l holds keys at k + l * layer_stride and values at v + l * layer_stride (elements), [Hkv, cap, D] each (a solo
 * KV cache, or the sequence's one page of a batched worker's pool); mask: [T, T] bytes, NULL for T == 1. */
typedef struct {
    long r0, T, start, cap, layer_stride;
    void *k, *v;
    const uint8_t *mask;
    uint8_t *q8;  /* decode_layers_q4: the int8 copy of the cache ([L] x q8_bytes(q8_cap, ...)), or NULL */
    long q8_cap;
} seq_t;

/* ---- the self-drafter's int8 copy of the committed K/V (its attention reads half the bytes, and scores 4 products
 * an instruction) ----
 * Per layer and KV head, slots rounded up to 16 (capT): K codes in tiles of 16 keys, a tile [D/4][16 keys][4 dims];
 * V codes in key pairs [capT/2][D][2]; each row's float32 scale (max |x| / 127, codes rounded) and its K codes' sum
 * (the u8 queries' offset). q8: [L] x q8_bytes(capT, Hkv, D), one layer's: K8 | V8 | kscale | vscale | ksum. */
static inline long q8_bytes(long capT, long Hkv, long D) { return Hkv * capT * (2 * D + 12); }
typedef struct { int8_t *k, *v; float *ks, *vs; int32_t *ksum; } q8_head_t;
static inline q8_head_t q8_head(const uint8_t *base, long capT, long Hkv, long D, long h) {
    q8_head_t r;
    r.k = (int8_t *)base + h * capT * D;  /* the copy's owner writes through these; attention only reads */
    r.v = (int8_t *)base + (Hkv + h) * capT * D;
    r.ks = (float *)(base + 2 * Hkv * capT * D) + h * capT;
    r.vs = (float *)(base + 2 * Hkv * capT * D) + (Hkv + h) * capT;
    r.ksum = (int32_t *)(base + 2 * Hkv * capT * D + 8 * Hkv * capT) + h * capT;
    return r;
}
/* codes of one bf16 row x [D] -> the scale; c[d * step] = round(x[d] / scale) (|c| <= 127), *sum = their sum */
static inline float q8_row(const uint16_t *x, long D, int8_t *c, long step, int32_t *sum) {
    __m512 mx = _mm512_setzero_ps();
    for (long d = 0; d < D; d += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(x + d, 0xffff)));
    float m = _mm512_reduce_max_ps(mx), scale = m / 127.0f, inv = m > 0.0f ? 127.0f / m : 0.0f;
    __m512i total = _mm512_setzero_si512();
    for (long d = 0; d < D; d += 16) {  /* rounded to nearest even (the default mode, as lrintf) */
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + d, 0xffff), _mm512_set1_ps(inv)));
        q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        total = _mm512_add_epi32(total, q);
        int8_t b[16];
        _mm_storeu_si128((__m128i *)b, _mm512_cvtepi32_epi8(q));
        if (step == 1)
            __builtin_memcpy(c + d, b, 16);
        else
            for (long i = 0; i < 16; i++) c[(d + i) * step] = b[i];
    }
    if (sum) *sum = _mm512_reduce_add_epi32(total);
    return scale;
}
/* slots [from, to) of one KV head's bf16 keys and values ([cap][D] each) into its codes */
static void q8_slots(const uint16_t *kh, const uint16_t *vh, q8_head_t o, long D, long from, long to) {
    for (long s = from; s < to; s++) {
        int8_t row[256], *kt = o.k + (s / 16) * 16 * D + (s % 16) * 4;  /* key s: tile s / 16, lane s % 16 */
        o.ks[s] = q8_row(kh + s * D, D, row, 1, o.ksum + s);
        for (long g = 0; g < D / 4; g++) __builtin_memcpy(kt + g * 64, row + 4 * g, 4);
        o.vs[s] = q8_row(vh + s * D, D, o.v + (s / 2) * 2 * D + (s % 2), 2, NULL);
    }
}
/* slots [from, to) of every layer and KV head of the bf16 cache k, v ([L][Hkv][cap][D], layers layer_stride apart)
 * into q8 ([L][q8_bytes(capT, Hkv, D)], capT >= cap, a multiple of 16) */
void quantize_kv_q8(const uint16_t *k, const uint16_t *v, long cap, long layer_stride, uint8_t *q8, long capT, long L,
                    long Hkv, long D, long from, long to, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long lh = 0; lh < L * Hkv; lh++) {
        long l = lh / Hkv, h = lh % Hkv, at = l * layer_stride + h * cap * D;
        q8_slots(k + at, v + at, q8_head(q8 + l * q8_bytes(capT, Hkv, D), capT, Hkv, D, h), D, from, to);
    }
}

/* each row's output from its chunks' partial sums (per chunk: o [16][D] unnormalised, max [16], sum [16]), merged by
 * their maxima (log-sum-exp) */
static void merge_block(const float *part, long chunks, long per, uint16_t *out, long rows, long rb, long blocks,
                        long G, long Hq, long D) {
    long kvh = rb / blocks, r0 = (rb % blocks) * 16, used = rows - r0 < 16 ? rows - r0 : 16;
    const float *base = part + rb * chunks * per;
    for (long l = 0; l < used; l++) {
        float m = -INFINITY, total = 0.0f;
        for (long c = 0; c < chunks; c++) m = fmaxf(m, base[c * per + 16 * D + l]);
        __m512 acc[16];
        for (long d = 0; d < D / 16; d++) acc[d] = _mm512_setzero_ps();
        for (long c = 0; c < chunks; c++) {
            const float *pc = base + c * per;
            if (pc[16 * D + 16 + l] == 0.0f) continue;
            float w = expf(pc[16 * D + l] - m);
            total += w * pc[16 * D + 16 + l];
            for (long d = 0; d < D / 16; d++)
                acc[d] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(pc + l * D + d * 16), acc[d]);
        }
        long r = r0 + l, t = r / G, h = kvh * G + r % G;
        for (long d = 0; d < D / 16; d++)
            store_bf16x16(out + (t * Hq + h) * D + d * 16, _mm512_mul_ps(acc[d], _mm512_set1_ps(1.0f / total)));
    }
}

#define Q8_SPLIT 256  /* keys a chunk: its int16 x int8 value sums stay within int32 (256 * 32767 * 127 < 2^31) */
#define Q8_AHEAD 2048  /* bytes: the codes a tile or key pair prefetches ahead (2,048 keys of 30 layers do not stay in
                        * cache between drafts; 30 layers at 2,048 keys 2.3 -> 1.7 ms with it) */
/* R (<= 4, a constant where inlined) rows' products with one tile of 16 keys' K codes: acc[l] lane j = row l's u8
 * codes . key j's codes (R a constant keeps the sums in registers) */
static inline __attribute__((always_inline)) void q8_tile_dots(const int8_t *tile, long D, const uint32_t (*qc)[64],
                                                               __m512i *acc, int R) {
    __m512i a[4];
    for (int l = 0; l < R; l++) a[l] = _mm512_setzero_si512();
    for (long g = 0; g < D / 4; g++) {
        _mm_prefetch((const char *)(tile + g * 64 + Q8_AHEAD), _MM_HINT_T0);
        __m512i kz = _mm512_loadu_si512(tile + g * 64);
        for (int l = 0; l < R; l++) a[l] = _mm512_dpbusd_epi32(a[l], _mm512_set1_epi32(qc[l][g]), kz);
    }
    for (int l = 0; l < R; l++) acc[l] = a[l];
}
/* R rows' value sums over n keys (pairs of V codes, v: [n/2][D][2]) from their int16 weights pw, times wscale -> o;
 * NB = D / 16 (R and NB constants where inlined keep the R x NB sums in registers) */
static inline __attribute__((always_inline)) void q8_values(const int8_t *v, long n, const int16_t (*pw)[Q8_SPLIT + 16],
                                                            const float *wscale, float *o, int R, long NB) {
    __m512i a[4][16];
    for (int l = 0; l < R; l++)
        for (long b = 0; b < NB; b++) a[l][b] = _mm512_setzero_si512();
    for (long s = 0; s < n; s += 2) {
        const int8_t *vp = v + s * NB * 16;
        _mm_prefetch((const char *)(vp + Q8_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(vp + Q8_AHEAD + 64), _MM_HINT_T0);
        for (long b = 0; b < NB; b++) {
            __m512i vz = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(vp + b * 32)));
            for (int l = 0; l < R; l++) {
                uint32_t pr;
                __builtin_memcpy(&pr, pw[l] + s, 4);
                a[l][b] = _mm512_dpwssd_epi32(a[l][b], vz, _mm512_set1_epi32(pr));
            }
        }
    }
    for (int l = 0; l < R; l++)
        for (long b = 0; b < NB; b++)
            _mm512_storeu_ps(o + l * NB * 16 + b * 16, _mm512_mul_ps(_mm512_cvtepi32_ps(a[l][b]), _mm512_set1_ps(wscale[l])));
}
#define Q8_PER(D) (16 * (D) + 32)  /* floats an item's partial results take: o [16][D], max [16], sum [16] */

/* one item of attend_split_q8: KV head kvh's block of 16 query rows against chunk c of the keys -> o (Q8_PER(D)) */
static void q8_item(const uint16_t *q, const uint8_t *q8, long capT, const uint8_t *mask, long T, long Hq, long Hkv,
                    long D, long start, float scale, long item, long blocks, long chunks, float *o) {
    long S = start + T, G = Hq / Hkv, rows = G * T;
    long c = item % chunks, blk = (item / chunks) % blocks, kvh = item / (chunks * blocks);
    long r0 = blk * 16, used = rows - r0 < 16 ? rows - r0 : 16, lo = c * Q8_SPLIT;
    long n = S - lo < Q8_SPLIT ? S - lo : Q8_SPLIT;
    q8_head_t hd = q8_head(q8, capT, Hkv, D, kvh);
    float sc[16 * Q8_SPLIT], *mx = o + 16 * D, *sum = mx + 16;
    float qs[16];
    uint32_t qc[16][64];  /* each row's u8 query codes, 4 dims a dword */
    __mmask16 sees_new[T];
    lanes_seeing_new(mask, T, G, r0, used, sees_new);
    for (long l = 0; l < used; l++) {
        long r = r0 + l, t = r / G, h = kvh * G + r % G;
        int8_t c[256];
        qs[l] = q8_row(q + (t * Hq + h) * D, D, c, 1, NULL) * scale;
        for (long d = 0; d < D; d++) ((uint8_t *)qc[l])[d] = (uint8_t)(c[d] + 128);
    }
    /* scores: tiles of 16 keys, lo a multiple of 16 */
    __m512 best[16];
    for (long l = 0; l < used; l++) best[l] = _mm512_set1_ps(-INFINITY);
    for (long k0 = 0; k0 < n; k0 += 16) {
        const int8_t *tile = hd.k + (lo + k0) * D;
        __m512i acc[16];
        for (long l0 = 0; l0 < used; l0 += 4) {
            switch (used - l0) {
                case 1: q8_tile_dots(tile, D, qc + l0, acc + l0, 1); break;
                case 2: q8_tile_dots(tile, D, qc + l0, acc + l0, 2); break;
                case 3: q8_tile_dots(tile, D, qc + l0, acc + l0, 3); break;
                default: q8_tile_dots(tile, D, qc + l0, acc + l0, 4);
            }
        }
        __mmask16 live = tail(n, k0);
        __m512i ksum = _mm512_maskz_loadu_epi32(live, hd.ksum + lo + k0);
        __m512 ks = _mm512_maskz_loadu_ps(live, hd.ks + lo + k0);
        __m512i off = _mm512_slli_epi32(ksum, 7);  /* the +128 offset's share: 128 * the key's code sum */
        for (long l = 0; l < used; l++) {
            __mmask16 seen = live;
            if (lo + k0 + 16 > start)  /* a tile of committed keys only: every row sees all of it */
                for (long j = 0; j < 16; j++)
                    if (lo + k0 + j >= start && k0 + j < n && !((sees_new[lo + k0 + j - start] >> l) & 1))
                        seen &= ~(1u << j);
            __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[l], off)),
                                     _mm512_mul_ps(ks, _mm512_set1_ps(qs[l])));
            x = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), x);
            _mm512_mask_storeu_ps(sc + l * Q8_SPLIT + k0, live, x);
            best[l] = _mm512_mask_max_ps(best[l], live, best[l], x);
        }
    }
    int16_t pw[16][Q8_SPLIT + 16];
    float wscale[16];
    for (long l = 0; l < used; l++) {
        float top = _mm512_reduce_max_ps(best[l]), *x = sc + l * Q8_SPLIT;
        mx[l] = top;
        sum[l] = top == -INFINITY ? 0.0f : 1.0f / softmax_row(x, n, top);
        __m512 wm = _mm512_setzero_ps();
        for (long s = 0; s < n; s += 16) {  /* probabilities times the V scales */
            __mmask16 m = tail(n, s);
            __m512 w = sum[l] == 0.0f ? _mm512_setzero_ps()
                                      : _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + s), _mm512_maskz_loadu_ps(m, hd.vs + lo + s));
            _mm512_mask_storeu_ps(x + s, m, w);
            wm = _mm512_max_ps(wm, w);
        }
        float w_max = _mm512_reduce_max_ps(wm), winv = w_max > 0.0f ? 32767.0f / w_max : 0.0f;
        wscale[l] = w_max / 32767.0f;
        for (long s = 0; s < n + 16; s += 16) {
            __mmask16 m = s < n ? tail(n, s) : 0;
            __m512i w = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + s), _mm512_set1_ps(winv)));
            _mm256_storeu_si256((__m256i *)(pw[l] + s), _mm512_cvtepi32_epi16(w));
        }
    }
    /* values: key pairs, 16 dims a vpdpwssd */
    const int8_t *vp = hd.v + lo * D;
    for (long l0 = 0; l0 < used; l0 += 4) {
        long R = used - l0 < 4 ? used - l0 : 4;
        const int16_t (*pr)[Q8_SPLIT + 16] = pw + l0;
        if (D == 64) {  /* smollm2's, Llama's heads: the sums in registers */
            switch (R) {
                case 1: q8_values(vp, n, pr, wscale + l0, o + l0 * D, 1, 4); break;
                case 2: q8_values(vp, n, pr, wscale + l0, o + l0 * D, 2, 4); break;
                case 3: q8_values(vp, n, pr, wscale + l0, o + l0 * D, 3, 4); break;
                default: q8_values(vp, n, pr, wscale + l0, o + l0 * D, 4, 4);
            }
        } else {
            q8_values(vp, n, pr, wscale + l0, o + l0 * D, R, D / 16);
        }
    }
}

/* The self-drafter's attention over the int8 copy (slots [0, start + T) quantized: the new rows' K/V included), split
 * for balance over 2 threads and 3 KV heads: per KV head, block of 16 rows and chunk of keys; each row's query in u8 codes (offset
 * 128, scale max |q| / 127) against the K codes (vpdpbusd, 4 products a lane), its probabilities times the V scales
 * in int16 codes against the V codes (vpdpwssd, a key pair a lane); merged across chunks by their maxima. */
int attend_split_q8(const uint16_t *q, const uint8_t *q8, long capT, const uint8_t *mask, uint16_t *out, long T, long Hq,
                    long Hkv, long D, long start, float scale, int threads) {
    long S = start + T, G = Hq / Hkv, rows = G * T, blocks = (rows + 15) / 16;
    long chunks = (S + Q8_SPLIT - 1) / Q8_SPLIT, items = Hkv * blocks * chunks, per = Q8_PER(D);
    float *part = (float *)malloc(items * per * sizeof(float));
    if (part == NULL) return -1;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long item = 0; item < items; item++)
        q8_item(q, q8, capT, mask, T, Hq, Hkv, D, start, scale, item, blocks, chunks, part + item * per);
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long rb = 0; rb < Hkv * blocks; rb++) merge_block(part, chunks, per, out, rows, rb, blocks, G, Hq, D);
    free(part);
    return 0;
}

/* a sequence's attention at layer l in decode_layers (its K/V just written): the plain kernels over its cache, or the
 * self-drafter's over the int8 copy, after the new rows' codes (the plain bf16 one where there is no copy or memory) */
#define ATTEND_SEQ(NAME, TYPE, FN)                                                                                  \
    static void NAME(const seq_t *sq, int l, const TYPE *q, TYPE *out, long Hq, long Hkv, long D, float scale,      \
                     float *scratch, int threads) {                                                                  \
        FN(q, (const TYPE *)sq->k + l * sq->layer_stride, (const TYPE *)sq->v + l * sq->layer_stride, sq->cap,       \
           sq->mask, out, sq->T, Hq, Hkv, D, sq->start, scale, scratch, threads);                                    \
    }
ATTEND_SEQ(attend_seq_bf16, uint16_t, attend_bf16)
ATTEND_SEQ(attend_seq_f32, float, attend_f32)
/* the sequence that item it belongs to, where sequence s's items are [first[s], first[s + 1]) */
static inline long owner(const long *first, long it) {
    long s = 0;
    while (first[s + 1] <= it) s++;
    return s;
}

/* Every sequence's attention at layer l in decode_layers (their K/V just written; sequence s's rows from r0). Several
 * sequences' blocks are the threads' items together (a batched step's sequences have 3 blocks each on smollm2: alone
 * they leave a thread idle or split each block), each in its thread's part of scratch (decode_layers' scores: a part
 * of Smax x 16 floats for each thread); one sequence takes ONE. Every row's numbers are those it gets alone (but for
 * a NaN score, which only a broken model gives: alone, past SPLIT_KEYS, its blocks may be split, and then its
 * maxima can differ: see ATTEND). */
#define ATTEND_SEQS(NAME, TYPE, ONE, BLOCK)                                                                          \
    static void NAME(const seq_t *seqs, long nseq, int l, const TYPE *q, TYPE *out, long Hq, long Hkv, long D,       \
                     float scale, float *scratch, int threads) {                                                     \
        long G = Hq / Hkv, first[nseq + 1], blocks[nseq], keys = 0;                                                  \
        first[0] = 0;                                                                                                \
        for (long s = 0; s < nseq; s++) { /* block it of sequence s: first[s] <= it < first[s + 1] */                \
            blocks[s] = (G * seqs[s].T + 15) / 16, first[s + 1] = first[s] + Hkv * blocks[s];                        \
            keys = seqs[s].start + seqs[s].T > keys ? seqs[s].start + seqs[s].T : keys;                              \
        }                                                                                                            \
        if (nseq == 1) {                                                                                             \
            ONE(seqs, l, q + seqs->r0 * Hq * D, out + seqs->r0 * Hq * D, Hq, Hkv, D, scale, scratch, threads);       \
            return;                                                                                                  \
        }                                                                                                            \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                                        \
        for (long it = 0; it < first[nseq]; it++) {                                                                  \
            long s = owner(first, it);                                                                               \
            const seq_t *sq = seqs + s;                                                                              \
            BLOCK(q + sq->r0 * Hq * D, (const TYPE *)sq->k + l * sq->layer_stride,                                   \
                  (const TYPE *)sq->v + l * sq->layer_stride, sq->cap, sq->mask, out + sq->r0 * Hq * D, sq->T, Hq, Hkv,\
                  D, sq->start, scale, it - first[s], blocks[s], scratch + omp_get_thread_num() * keys * 16);        \
        }                                                                                                            \
    }
ATTEND_SEQS(attend_seqs_bf16, uint16_t, attend_seq_bf16, attend_bf16_block)
ATTEND_SEQS(attend_seqs_f32, float, attend_seq_f32, attend_f32_block)

/* the self-drafter's: each sequence's new rows' codes into its int8 copy, then all sequences' items (those of
 * attend_split_q8) in one parallel loop and their merges in another (a draft's sequences have a row each: too little
 * work apiece to split across threads alone); a sequence without a copy, or all where the partial sums find no memory:
 * the plain one */
static void attend_seqs_q8(const seq_t *seqs, long nseq, int l, const uint16_t *q, uint16_t *out, long Hq, long Hkv,
                           long D, float scale, float *scratch, int threads) {
    long G = Hq / Hkv, per = Q8_PER(D), first[nseq + 1], first_rb[nseq + 1], blocks[nseq], chunks[nseq];
    const uint8_t *codes[nseq];
    first[0] = first_rb[0] = 0;
    for (long s = 0; s < nseq; s++) {  /* item it of sequence s: first[s] <= it < first[s + 1]; merges: first_rb */
        const seq_t *sq = seqs + s;
        long S = sq->start + sq->T;
        blocks[s] = (G * sq->T + 15) / 16, chunks[s] = (S + Q8_SPLIT - 1) / Q8_SPLIT;
        codes[s] = sq->q8 == NULL ? NULL : sq->q8 + l * q8_bytes(sq->q8_cap, Hkv, D);
        for (long h = 0; codes[s] != NULL && h < Hkv; h++) {
            long at = l * sq->layer_stride + h * sq->cap * D;
            q8_slots((const uint16_t *)sq->k + at, (const uint16_t *)sq->v + at,
                     q8_head(codes[s], sq->q8_cap, Hkv, D, h), D, sq->start, S);
        }
        first[s + 1] = first[s] + (codes[s] != NULL ? Hkv * blocks[s] * chunks[s] : 0);
        first_rb[s + 1] = first_rb[s] + (codes[s] != NULL ? Hkv * blocks[s] : 0);
    }
    float *part = first[nseq] ? (float *)malloc(first[nseq] * per * sizeof(float)) : NULL;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long it = 0; it < (part ? first[nseq] : 0); it++) {
        long s = owner(first, it);
        const seq_t *sq = seqs + s;
        q8_item(q + sq->r0 * Hq * D, codes[s], sq->q8_cap, sq->mask, sq->T, Hq, Hkv, D, sq->start, scale,
                it - first[s], blocks[s], chunks[s], part + it * per);
    }
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long it = 0; it < (part ? first_rb[nseq] : 0); it++) {
        long s = owner(first_rb, it);
        merge_block(part + first[s] * per, chunks[s], per, out + seqs[s].r0 * Hq * D, G * seqs[s].T, it - first_rb[s],
                    blocks[s], G, Hq, D);
    }
    for (long s = 0; s < nseq; s++)
        if (part == NULL || codes[s] == NULL)
            attend_seq_bf16(seqs + s, l, q + seqs[s].r0 * Hq * D, out + seqs[s].r0 * Hq * D, Hq, Hkv, D, scale,
                            scratch, threads);
    free(part);
}

/* SUFFIX's helpers and decode_layers_SUFFIX over TYPE storage (LOAD / STORE / ROUND: 16 values as float32, masked).
 *
 * rms_norm: out[t] = w * R(x[t] * rsqrt(mean(x[t]^2) + eps)) (HF's RMSNorm), rows of H.
 * add_into: x[i] = R(x[i] + y[i]) (the residual stream).
 * silu_mul: a[t] = R(R(silu(gate[t])) * up[t]) for gu[t] = [gate | up], each I wide.
 * rope_head: x * cos + rotate_half(x) * sin for one head's D values (D % 32 == 0), each product and the sum rounded
 *   (as torch): out[i] = x[i] cos[i] - x[i + D/2] sin[i], out[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2].
 * decode_layers: the layers over T new tokens of nseq sequences (each sequence's rows see every earlier slot of its
 *   cache and its new slots under its mask; products and norms take all T rows at once, each row computed alone, so a
 *   row's values do not depend on the sequences beside it); x [T, H], the residual stream, updated in place. cos, sin:
 *   [T, D] (HF's rotary for the rows' positions). work: scratch of T * (2H + (Hq + 2Hkv)D + 2 Hq D + 3I) values;
 *   scores: the attention's scratch, max(Hkv * ceil(G * Tmax / 16), threads) x Smax x 16 floats (Tmax: the most rows
 *   of a sequence, Smax: the most keys; cpu_kernels.py attend_scratch); queries: NULL, or [L, T, Hq, D] for each layer's
 *   rotated queries (the self-drafter's KV importance reads them). */
#define LAYERS(SUFFIX, TYPE, LOAD, STORE, ROUND, GEMV, ATTEND_FN)                                                  \
    static void rms_norm_##SUFFIX(const TYPE *x, const TYPE *w, TYPE *out, long T, long H, float eps) {            \
        for (long t = 0; t < T; t++) {                                                                             \
            const TYPE *xt = x + t * H;                                                                            \
            __m512 ss = _mm512_setzero_ps();                                                                       \
            for (long i = 0; i < H; i += 16) {                                                                     \
                __m512 v = LOAD(xt + i, tail(H, i));                                                               \
                ss = _mm512_fmadd_ps(v, v, ss);                                                                    \
            }                                                                                                      \
            __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps));                    \
            for (long i = 0; i < H; i += 16) {                                                                     \
                __mmask16 m = tail(H, i);                                                                          \
                STORE(out + t * H + i, m, _mm512_mul_ps(LOAD(w + i, m), ROUND(_mm512_mul_ps(LOAD(xt + i, m), r)))); \
            }                                                                                                      \
        }                                                                                                          \
    }                                                                                                              \
    static void add_into_##SUFFIX(TYPE *x, const TYPE *y, long n) {                                                \
        for (long i = 0; i < n; i += 16) {                                                                         \
            __mmask16 m = tail(n, i);                                                                              \
            STORE(x + i, m, _mm512_add_ps(LOAD(x + i, m), LOAD(y + i, m)));                                        \
        }                                                                                                          \
    }                                                                                                              \
    static void silu_mul_##SUFFIX(const TYPE *gu, TYPE *a, long T, long I) {                                       \
        for (long t = 0; t < T; t++)                                                                               \
            for (long i = 0; i < I; i += 16) {                                                                     \
                __mmask16 m = tail(I, i);                                                                          \
                __m512 g = LOAD(gu + t * 2 * I + i, m);                                                            \
                __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));                                           \
                __m512 s = ROUND(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));                        \
                STORE(a + t * I + i, m, _mm512_mul_ps(s, LOAD(gu + t * 2 * I + I + i, m)));                        \
            }                                                                                                      \
    }                                                                                                              \
    static void rope_head_##SUFFIX(const TYPE *x, const TYPE *cs, const TYPE *sn, TYPE *out, long D) {             \
        long half = D / 2;                                                                                         \
        for (long i = 0; i < half; i += 16) {                                                                      \
            __m512 lo = LOAD(x + i, 0xffff), hi = LOAD(x + half + i, 0xffff);                                      \
            __m512 a = ROUND(_mm512_mul_ps(lo, LOAD(cs + i, 0xffff)));                                             \
            __m512 b = ROUND(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi), LOAD(sn + i, 0xffff)));         \
            STORE(out + i, 0xffff, _mm512_add_ps(a, b));                                                           \
            a = ROUND(_mm512_mul_ps(hi, LOAD(cs + half + i, 0xffff)));                                             \
            b = ROUND(_mm512_mul_ps(lo, LOAD(sn + half + i, 0xffff)));                                             \
            STORE(out + half + i, 0xffff, _mm512_add_ps(a, b));                                                    \
        }                                                                                                          \
    }                                                                                                              \
    void decode_layers_##SUFFIX(const layer_t *layers, int L, TYPE *x, long T, long H, long I, long Hq, long Hkv,  \
                                long D, const seq_t *seqs, long nseq, const TYPE *cos, const TYPE *sin, float eps, \
                                float scale, TYPE *work, float *scores, TYPE *queries, int threads) {              \
        long nqkv = (Hq + 2 * Hkv) * D;                                                                            \
        TYPE *h = work, *qkv = h + T * H, *q = qkv + T * nqkv, *att = q + T * Hq * D, *tmp = att + T * Hq * D;     \
        TYPE *gu = tmp + T * H, *a = gu + T * 2 * I;                                                               \
        for (int l = 0; l < L; l++) {                                                                              \
            const layer_t *ly = layers + l;                                                                        \
            rms_norm_##SUFFIX(x, (const TYPE *)ly->ln1, h, T, H, eps);                                             \
            GEMV(h, (const TYPE *)ly->qkv, ly->b_qkv, qkv, T, nqkv, H, threads);                                   \
            for (long s = 0; s < nseq; s++) {                                                                      \
                const seq_t *sq = seqs + s;                                                                        \
                TYPE *kc = (TYPE *)sq->k + l * sq->layer_stride, *vc = (TYPE *)sq->v + l * sq->layer_stride;       \
                for (long t = sq->r0; t < sq->r0 + sq->T; t++) {                                                   \
                    const TYPE *row = qkv + t * nqkv, *ct = cos + t * D, *st = sin + t * D;                        \
                    for (long hq = 0; hq < Hq; hq++)                                                               \
                        rope_head_##SUFFIX(row + hq * D, ct, st, q + (t * Hq + hq) * D, D);                        \
                    for (long hk = 0; hk < Hkv; hk++) {                                                            \
                        long slot = (hk * sq->cap + sq->start + t - sq->r0) * D;                                   \
                        rope_head_##SUFFIX(row + (Hq + hk) * D, ct, st, kc + slot, D);                             \
                        __builtin_memcpy(vc + slot, row + (Hq + Hkv + hk) * D, D * sizeof(TYPE));                  \
                    }                                                                                              \
                }                                                                                                  \
            }                                                                                                      \
            if (queries != NULL) __builtin_memcpy(queries + l * T * Hq * D, q, T * Hq * D * sizeof(TYPE));       \
            ATTEND_FN(seqs, nseq, l, q, att, Hq, Hkv, D, scale, scores, threads);                                  \
            GEMV(att, (const TYPE *)ly->o, ly->b_o, tmp, T, H, Hq * D, threads);                                   \
            add_into_##SUFFIX(x, tmp, T * H);                                                                      \
            rms_norm_##SUFFIX(x, (const TYPE *)ly->ln2, h, T, H, eps);                                             \
            GEMV(h, (const TYPE *)ly->gate_up, ly->b_gate_up, gu, T, 2 * I, H, threads);                           \
            silu_mul_##SUFFIX(gu, a, T, I);                                                                        \
            GEMV(a, (const TYPE *)ly->down, ly->b_down, tmp, T, H, I, threads);                                    \
            add_into_##SUFFIX(x, tmp, T * H);                                                                      \
        }                                                                                                          \
    }
LAYERS(bf16, uint16_t, load16, store16, round16, gemv_bf16, attend_seqs_bf16)
LAYERS(f32, float, load16_f32, store16_f32, round16_f32, gemv_f32, attend_seqs_f32)
/* the quantized self-drafter's layers: bf16 activations and cache, 4-bit products, attention over the int8 copy */
LAYERS(q4, uint16_t, load16, store16, round16, gemv_q4, attend_seqs_q8)
/* out[t] = the RMSNorm of x[t] (rms_norm_bf16): the self-drafter's final norm, one call where HF's module is ~10 */
void rms_norm_rows_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, long T, long H, float eps) {
    rms_norm_bf16(x, w, out, T, H, eps);
}


/* the largest of r's V values (-inf for none); *nan: whether r has a NaN (the max is then not meaningful). Dead lanes
 * of the last block load -inf and count no NaN. */
static inline float row_max(const float *r, long V, int *nan) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 unord = 0;
    for (long i = 0; i < V; i += 16) {
        __mmask16 live = tail(V, i);
        __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, r + i);
        unord |= _mm512_mask_cmp_ps_mask(live, v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, v);
    }
    *nan = unord != 0;
    return _mm512_reduce_max_ps(m);
}

/* out[t] = torch's argmax of row t of x [T, V] float32: the first NaN if the row has one, else the first maximal value
 * (-0.0 equals 0.0). torch's CPU argmax read one 49,152-wide row at ~2.5 GB/s (78 us; 2.6 ms for 64 rows), on every
 * greedy step and in the sampled likeliest statistic; two vector passes here, the second stopping at the first hit
 * (the last block's dead lanes masked, as in topk_f32). */
void argmax_f32(const float *x, long T, long V, int64_t *out, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long t = 0; t < T; t++) {
        const float *r = x + t * V;
        int nan;
        __m512 b = _mm512_set1_ps(row_max(r, V, &nan));  /* NaN-free when nan is 0 (then it is not read) */
        long idx = V;
        for (long i = 0; i < V && idx == V; i += 16) {
            __mmask16 live = tail(V, i);
            __m512 v = _mm512_maskz_loadu_ps(live, r + i);
            __mmask16 k = nan ? _mm512_mask_cmp_ps_mask(live, v, v, _CMP_UNORD_Q)
                              : _mm512_mask_cmp_ps_mask(live, v, b, _CMP_EQ_OQ);
            if (k) idx = i + __builtin_ctz((unsigned)k);
        }
        out[t] = idx == V ? 0 : idx;
    }
}

/* y (column j) into the descending list val/id of n <= k entries, after its equals (index order if columns come
 * ascending); returns whether it entered (a full list takes only a value above its last) */
static inline int top_insert(float *val, int64_t *id, int *n, int k, float y, int64_t j) {
    if (*n == k && !(y > val[k - 1])) return 0;
    int p = *n < k ? (*n)++ : k - 1;
    while (p > 0 && val[p - 1] < y) { val[p] = val[p - 1]; id[p] = id[p - 1]; p--; }
    val[p] = y; id[p] = j;
    return 1;
}

/* idx[t, :k] = the k largest values of row t of x [T, V] float32, descending, equal values in index order; NaNs skipped.
 * Returns 0, or 1 if some row has fewer than k non-NaN values (the caller falls back to torch.topk). k <= 64.
 * torch.topk took 110 us a 49,152-wide row here (2.8 ms for 64 rows), on every verify the recycling matrix learns
 * from; one vector pass here that only stops at the few lanes above the running k-th value. */
int topk_f32(const float *x, long T, long V, int k, int64_t *idx, int threads) {
    int short_rows = 0;
    _Pragma("omp parallel for schedule(static) num_threads(threads) reduction(|:short_rows)")
    for (long t = 0; t < T; t++) {
        const float *r = x + t * V;
        float val[64];
        int64_t id[64];
        int n = 0;
        float thr = -INFINITY;  /* the k-th value once n == k: only greater ones enter */
        for (long i = 0; i < V; i += 16) {
            __mmask16 live = tail(V, i);
            __m512 v = _mm512_maskz_loadu_ps(live, r + i);
            __mmask16 m = n < k ? (live & _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q))
                                : _mm512_mask_cmp_ps_mask(live, v, _mm512_set1_ps(thr), _CMP_GT_OQ);
            while (m) {
                long j = i + __builtin_ctz((unsigned)m);
                m &= m - 1;
                if (top_insert(val, id, &n, k, r[j], j) && n == k) thr = val[k - 1];
            }
        }
        if (n < k) short_rows = 1;
        for (int q = 0; q < k; q++) idx[t * k + q] = q < n ? id[q] : 0;
    }
    return short_rows;
}

/* ---- sampled tokens (sampling.py's process_logits then sample, for penalty + temperature + min-p) ----
 * The noise hash of sampling.py (_mix32, _key_bits, _bits, _gumbel_of_bits) in the same integer steps: values may pass
 * 2^32 between mixes, as Python's integers do, and each mix reduces them as its _mul32 does. */
#define M32 0xFFFFFFFFull
static inline uint64_t mix32(uint64_t x) {
    x ^= x >> 16;
    x = (x * 0x7FEB352Dull) & M32;
    x ^= x >> 15;
    x = (x * 0x846CA68Bull) & M32;
    return x ^ (x >> 16);
}

/* The float64 noise of (position key, token) as torch computes it but for the log: libm's here, torch's (vectorised)
 * log differs from libm's in ~0.1% of float64 values; scanning all 2^32 noise inputs (h fixes h2) found none whose
 * float32 noise, the value added to a float32 score, differs (torch 2.13's AVX512, AVX2 and default code paths). */
static inline double gumbel_at(uint64_t key, uint64_t v) {
    uint64_t h = mix32(mix32(key ^ mix32(v + 0x9E3779B9ull)) + 0x632BE5ABull), h2 = mix32(h ^ 0x5BD1E995ull);
    double u = ((double)(h >> 5) * 67108864.0 + (double)(h2 >> 6) + 0.5) / 9007199254740992.0;
    return -log(-log(u));
}

/* 16 logits processed: penalty theta where present (x / theta if x > 0 else x * theta), then temperature (1: none) */
static inline __m512 process16(__m512 x, __mmask16 present, float theta, float temp) {
    __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
    __m512 pen = _mm512_mask_div_ps(_mm512_mul_ps(x, _mm512_set1_ps(theta)), pos, x, _mm512_set1_ps(theta));
    x = _mm512_mask_blend_ps(present, x, pen);
    return temp != 1.0f ? _mm512_div_ps(x, _mm512_set1_ps(temp)) : x;
}

/* the lanes of counts[v .. v + 16) (masked: m) above 0: the tokens the penalty window holds (counts NULL: none) */
static inline __mmask16 counted16(const int32_t *counts, long v, __mmask16 m) {
    return counts == NULL ? 0 : _mm512_mask_cmpgt_epi32_mask(m, _mm512_maskz_loadu_epi32(m, counts + v),
                                                             _mm512_setzero_si512());
}

/* coarse[v .. v + 16) as float32 with the penalty theta on the tokens counted (masked lanes: m) */
static inline __m512 penalised16(const uint16_t *coarse, const int32_t *counts, long v, __mmask16 m, float theta) {
    return process16(load16(coarse + v, m), counted16(counts, v, m), theta, 1.0f);
}

/* The self-drafter's logits from a coarse (4-bit) head's: out[v] = h . W[v] (bf16 products summed in float32, rounded
 * to bf16 as the model's head rounds) for each v whose penalised coarse logit (process16's penalty theta on tokens
 * with counts > 0; counts NULL: none) is at least the best one less `below`, -inf for the rest; returns how many were
 * rescored. W: [V, H] bf16 rows, H % 32 == 0. Only tokens near the top can be drafted (min-p): their exact rows cost
 * ~1% of an 8-bit head's 31 MB. */
static long rescore_bf16(const uint16_t *coarse, long V, const int32_t *counts, const uint16_t *h, const uint16_t *W, long H,
                  float theta, float below, float *out) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (long v = 0; v < V; v += 16) {
        __mmask16 m = tail(V, v);
        top = _mm512_mask_max_ps(top, m, top, penalised16(coarse, counts, v, m, theta));
    }
    float thr = _mm512_reduce_max_ps(top) - below;
    long n = 0;
    for (long v = 0; v < V; v += 16) {
        __mmask16 m = tail(V, v);
        __mmask16 hit = _mm512_mask_cmp_ps_mask(m, penalised16(coarse, counts, v, m, theta), _mm512_set1_ps(thr),
                                                _CMP_GE_OQ);
        _mm512_mask_storeu_ps(out + v, m, _mm512_set1_ps(-INFINITY));
        for (; hit; hit &= hit - 1, n++) {
            long r = v + __builtin_ctz(hit);
            __m512 acc = _mm512_setzero_ps();
            for (long i = 0; i < H; i += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(W + r * H + i),
                                       (__m512bh)_mm512_loadu_si512(h + i));
            out[r] = _mm512_cvtss_f32(round16(_mm512_set1_ps(_mm512_reduce_add_ps(acc))));
        }
    }
    return n;
}

/* rescore_bf16 for the B rows of a draft's depth (row b: coarse + b V, counts[b] (counts or counts[b] NULL: none), h +
 * b H, thetas[b], belows[b], out + b V; n[b] rescored), the rows split across threads */
void rescore_rows_bf16(const uint16_t *coarse, long B, long V, const int32_t *const *counts, const uint16_t *h,
                       const uint16_t *W, long H, const float *thetas, const float *belows, float *out, long *n,
                       int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long b = 0; b < B; b++)
        n[b] = rescore_bf16(coarse + b * V, V, counts ? counts[b] : NULL, h + b * H, W, H, thetas[b], belows[b],
                            out + b * V);
}

/* s = row l processed; present: counts[v] > 0 (counts NULL: no penalty) but where a patch (p with rows[p] == t) says
 * otherwise */
static inline void process_row(const float *l, float *s, long t, long V, const int32_t *counts, const int64_t *rows,
                               const int64_t *cols, const uint8_t *vals, long n_patches, float theta, float temp) {
    for (long i = 0; i < V; i += 16) {
        __mmask16 live = tail(V, i);
        __m512 x = _mm512_maskz_loadu_ps(live, l + i);
        _mm512_mask_storeu_ps(s + i, live, process16(x, counted16(counts, i, live), theta, temp));
    }
    for (long p = 0; counts != NULL && p < n_patches; p++)
        if (rows[p] == t) s[cols[p]] = _mm512_cvtss_f32(process16(_mm512_set1_ps(l[cols[p]]), vals[p] ? 1 : 0, theta, temp));
}

/* The block of 16 at s + i (of V): values below thr cut to -inf; returns the lanes kept (live, above -inf) */
static inline __mmask16 cut_block(float *s, long V, long i, float thr) {
    __mmask16 live = tail(V, i);
    __m512 x = _mm512_maskz_loadu_ps(live, s + i);
    __mmask16 cut = _mm512_mask_cmp_ps_mask(live, x, _mm512_set1_ps(thr), _CMP_LT_OQ);
    _mm512_mask_storeu_ps(s + i, cut, _mm512_set1_ps(-INFINITY));
    return live & ~cut & _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ);
}

/* Cut s below its max + log_min_p to -inf; returns the kept token with the largest score + float32 noise, the first
 * among equals (sample()'s scatter_reduce), 0 if none is kept, or -1 if s has a NaN (then s is left as it is) */
static inline long sample_row(float *s, long V, float log_min_p, uint64_t key) {
    int nan;
    float thr = row_max(s, V, &nan) + log_min_p, best = -INFINITY;
    if (nan) return -1;
    long pick = -1;
    for (long i = 0; i < V; i += 16) {
        for (__mmask16 kept = cut_block(s, V, i, thr); kept; kept &= kept - 1) {
            long j = i + __builtin_ctz((unsigned)kept);
            float z = s[j] + (float)gumbel_at(key, (uint64_t)j);
            if (pick < 0 || z > best) { best = z; pick = j; }
        }
    }
    return pick < 0 ? 0 : pick;
}

/* out[t] = process_logits(logits[t]) for penalty theta on the tokens row t's counts hold present (counts[t][v] > 0;
 * counts NULL or counts[t] NULL: no penalty), overridden per row by the patches (rows[p], cols[p]) -> vals[p], with
 * rows in [0, T) and cols in [0, V); temperature temp (1: none) and min-p (scores below the row's max + log_min_p
 * dropped to -inf); choice[t] = sample(): the kept token with the largest score + noise of (positions[t], token) under
 * row t's seed halves seeds[2t], seeds[2t + 1]. Rows are independent: several sequences' rows go in one call. Every
 * float op is the one torch does there (float32, in the same order). Returns 1 if a row has a NaN (the caller falls
 * back to torch), else 0. */
int sample_minp_f32(const float *logits, long T, long V, const int32_t *const *counts, const int64_t *rows,
                    const int64_t *cols, const uint8_t *vals, long n_patches, float theta, float temp, float log_min_p,
                    const uint64_t *seeds, const int64_t *positions, float *out, int64_t *choice, int threads) {
    int bad = 0;
    _Pragma("omp parallel for schedule(static) num_threads(threads) reduction(|:bad)")
    for (long t = 0; t < T; t++) {
        process_row(logits + t * V, out + t * V, t, V, counts ? counts[t] : NULL, rows, cols, vals, n_patches, theta,
                    temp);
        uint64_t key = mix32(mix32((uint64_t)positions[t] ^ seeds[2 * t]) ^ seeds[2 * t + 1]);
        choice[t] = sample_row(out + t * V, V, log_min_p, key);
        bad |= choice[t] < 0;
    }
    return bad;
}

/* A drafter level (recurrent.py's _processed then _top_children) for temperature + min-p with the penalty or not:
 * row t of z [R, N] (logits over the drafter's tokens vocab[N]) processed into out [R, N] by process_row (penalty theta
 * where counts[n] > 0, counts NULL: none; temperature temp), cut below its max + log_min_p to -inf, the kept scores
 * plus AR's noise of (position, vocab[n]) under the seed's 32-bit halves; then the k best (descending, equal values in
 * index order; -inf and index 0 past the kept ones) into val/idx [R, k] and the row's logsumexp over its kept scores
 * into lse [R] (-inf if none). One call a level where ~25 torch ops took 0.5-0.7 ms on smollm2's drafter (8,192
 * tokens). k <= 64. Returns 1 if a row has a NaN (the caller falls back to torch), else 0. */
int draft_level_f32(const float *z, long R, long N, const int32_t *counts, const int64_t *vocab, float theta,
                    float temp, float log_min_p, uint64_t s_lo, uint64_t s_hi, int64_t position, int k, float *out,
                    float *val, int64_t *idx, float *lse, int threads) {
    uint64_t key = mix32(mix32((uint64_t)position ^ s_lo) ^ s_hi);
    int bad = 0;
    _Pragma("omp parallel for schedule(static) num_threads(threads) reduction(|:bad)")
    for (long t = 0; t < R; t++) {
        float *s = out + t * N, *v = val + t * k;
        int64_t *id = idx + t * k;
        process_row(z + t * N, s, t, N, counts, NULL, NULL, NULL, 0, theta, temp);
        int nan, n = 0;
        float thr = row_max(s, N, &nan) + log_min_p;
        if (nan) { bad = 1; continue; }
        for (long i = 0; i < N; i += 16) {
            for (__mmask16 kept = cut_block(s, N, i, thr); kept; kept &= kept - 1) {
                long j = i + __builtin_ctz((unsigned)kept);
                top_insert(v, id, &n, k, s[j] = s[j] + (float)gumbel_at(key, (uint64_t)vocab[j]), j);
            }
        }
        double sum = 0.0;  /* the kept scores' exp relative to the best, in float64: a few terms, no cancellation */
        for (long i = 0; n > 0 && i < N; i += 16) {
            __mmask16 kept = tail(N, i) & _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(tail(N, i), s + i),
                                                             _mm512_set1_ps(-INFINITY), _CMP_GT_OQ);
            for (; kept; kept &= kept - 1) sum += exp((double)s[i + __builtin_ctz((unsigned)kept)] - (double)v[0]);
        }
        lse[t] = n > 0 ? (float)((double)v[0] + log(sum)) : -INFINITY;
        for (int q = n; q < k; q++) { v[q] = -INFINITY; id[q] = 0; }
    }
    return bad;
}
