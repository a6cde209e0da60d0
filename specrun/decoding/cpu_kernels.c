/* bf16 matrix-vector products for the decode step on x86 CPUs with AVX-512 BF16 (cpu_kernels.py compiles and loads
 * this file). A decode step streams every weight once: the kernel is bound by memory reads, so it prefetches whole
 * weight rows ahead and keeps the arithmetic (vdpbf16ps, float32 accumulation) out of the way.
 *
 * Each output element is reduced in the same order whatever M and the thread count: a row's result does not depend
 * on which rows run beside it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define R 4        /* weight rows per group: four independent accumulators per input row */
#define AHEAD 16   /* weight rows prefetched ahead of the group being read (measured best of 8 / 16 / 32) */

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch's float -> bfloat16 */
    __m128bh r = _mm_cvtneps_pbh(_mm_set1_ps(f));
    return ((uint16_t *)&r)[0];
}

/* y[m, n0 .. n0+RN) for MB input rows; w0 = w + n0 * K. int indices: a first variant with long ones ran ~20% slower
 * here (measured side by side; the cause not found) */
#define GROUP(RN, MB)                                                                                              \
    static inline __attribute__((always_inline)) void group_##RN##_##MB(                                           \
        const uint16_t *x, const uint16_t *w0, const float *b, uint16_t *y, int N, int K, int n0) {                \
        __m512 acc[RN][MB];                                                                                        \
        for (int j = 0; j < RN; j++)                                                                               \
            for (int m = 0; m < MB; m++) acc[j][m] = _mm512_setzero_ps();                                          \
        for (int k = 0; k < K; k += 32) {                                                                          \
            __mmask32 live = K - k >= 32 ? 0xffffffffu : (1u << (K - k)) - 1;                                      \
            __m512bh wv[RN];                                                                                       \
            for (int j = 0; j < RN; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(live, w0 + j * K + k);         \
            for (int m = 0; m < MB; m++) {                                                                         \
                __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(live, x + (long)m * K + k);                       \
                for (int j = 0; j < RN; j++) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], wv[j], xv);                   \
            }                                                                                                      \
        }                                                                                                          \
        for (int m = 0; m < MB; m++)                                                                               \
            for (int j = 0; j < RN; j++)                                                                           \
                y[(long)m * N + n0 + j] = to_bf16(_mm512_reduce_add_ps(acc[j][m]) + (b ? b[n0 + j] : 0.0f));     \
    }
GROUP(4, 1)
GROUP(4, 2)
GROUP(1, 1)
GROUP(1, 2)

/* y[M, N] = x[M, K] w[N, K]^T (+ b[N]); x, w, y bfloat16 (as uint16), b float32 or NULL; all contiguous;
 * N * K < 2^31 */
void gemv_bf16(const uint16_t *x, const uint16_t *w, const float *b, uint16_t *y, long M, long N, long K,
               int threads) {
    int full = N / R * R;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int n0 = 0; n0 < full; n0 += R) {
        const uint16_t *w0 = w + (long)n0 * K;
        for (int byte = 0; byte < R * K * 2; byte += 64)  /* never faults, even past the end of w */
            _mm_prefetch((const char *)(w0 + AHEAD * K) + byte, _MM_HINT_T0);
        for (int m = 0; m < M; m += 2) {
            if (M - m >= 2) group_4_2(x + m * K, w0, b, y + m * N, N, K, n0);
            else group_4_1(x + m * K, w0, b, y + m * N, N, K, n0);
        }
    }
    for (int n0 = full; n0 < N; n0++)  /* the last N % 4 rows */
        for (int m = 0; m < M; m += 2) {
            if (M - m >= 2) group_1_2(x + m * K, w + (long)n0 * K, b, y + m * N, N, K, n0);
            else group_1_1(x + m * K, w + (long)n0 * K, b, y + m * N, N, K, n0);
        }
}

/* Attention of T new query rows over a head-major KV cache whose slots [0, start + T) hold the prefix and the new
 * tokens: row t sees every prefix slot and the new slots j with mask[t, j] (mask NULL: T == 1, the row sees itself).
 * Scores, softmax and the weighted sum of values in float32, the output rounded to bf16 once. Each (head, row) is
 * computed alone and in one order: a row's output does not depend on the other rows or the thread count.
 *
 * q, out: [T, Hq, D] bf16; k, v: [Hkv, cap, D] bf16; mask: [T, T] bytes or NULL; scores: [Hq * T, start + T] float32
 * scratch. D % 32 == 0, D <= 256, Hq % Hkv == 0. */
void attend_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, long cap, const uint8_t *mask, uint16_t *out,
                 long T, long Hq, long Hkv, long D, long start, float scale, float *scores, int threads) {
    long S = start + T, G = Hq / Hkv;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long item = 0; item < Hq * T; item++) {
        long h = item / T, t = item % T;
        const uint16_t *qr = q + (t * Hq + h) * D;
        const uint16_t *kh = k + (h / G) * cap * D, *vh = v + (h / G) * cap * D;
        float *sc = scores + item * S, top = -INFINITY, total = 0.0f;
        for (long s = 0; s < S; s++) {
            if (s >= start && mask != NULL && !mask[t * T + (s - start)]) {
                sc[s] = -INFINITY;
                continue;
            }
            __m512 acc = _mm512_setzero_ps();
            for (long d = 0; d < D; d += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(kh + s * D + d),
                                       (__m512bh)_mm512_loadu_si512(qr + d));
            sc[s] = _mm512_reduce_add_ps(acc) * scale;
            top = sc[s] > top ? sc[s] : top;
        }
        for (long s = 0; s < S; s++) {
            sc[s] = sc[s] == -INFINITY ? 0.0f : expf(sc[s] - top);
            total += sc[s];
        }
        __m512 o[16];  /* D / 16 float32 lanes of the output row */
        for (long d = 0; d < D / 16; d++) o[d] = _mm512_setzero_ps();
        for (long s = 0; s < S; s++) {
            if (sc[s] == 0.0f) continue;
            __m512 p = _mm512_set1_ps(sc[s]);
            for (long d = 0; d < D / 16; d++)
                o[d] = _mm512_fmadd_ps(p, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(vh + s * D + d * 16))), o[d]);
        }
        __m512 inv = _mm512_set1_ps(1.0f / total);
        for (long d = 0; d < D / 16; d++)
            _mm256_storeu_si256((__m256i *)(out + (t * Hq + h) * D + d * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[d], inv)));
    }
}
