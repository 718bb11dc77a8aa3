/* The row loops an AVX-512 build of the kernel swaps in (included by products.h where the compiler targets
   AVX-512BW; final/engine/kernels/__init__.py builds one per instruction set the CPU has and loads the best).
   The AVX2 loops in products.h stay the reference: these compute the same products with fewer instructions, so
   they pay where a core, not memory, is the limit (int8 at several rows, bf16 at 1-4 rows, one thread). */
#pragma once

/* int8 (see products.h's q8_group): a pair of k for all 16 rows of a group is one 512-bit widening, and each
   activation row one broadcast and one vpmaddwd; 4 activation rows a pass (AVX-512's 32 registers). With
   AVX512-VNNI, vpdpwssd does the vpmaddwd and its add in one instruction (the same int32 sum: no block can
   overflow, see products.h), over Q8_CHAINS independent sums a row, since each waits ~4 cycles on the one before
   (one chain of vpdpwssd was no faster than vpmaddwd + vpaddd): fewer instructions a weight, which pays where the
   core is the limit: a batch-8 step 1.13x, batch 1 1.03x (bench/RESULTS.md). -DNO_VNNI keeps vpmaddwd (A/B). */
#define Q8_PASS 4
#if defined(__AVX512VNNI__) && !defined(NO_VNNI)
#define Q8_CHAINS(P) ((P) == 1 ? 4 : (P) == 2 ? 2 : 1)
#define Q8_DOT(d, w, x) _mm512_dpwssd_epi32(d, w, x)
#else
#define Q8_CHAINS(P) 1
#define Q8_DOT(d, w, x) _mm512_add_epi32(d, _mm512_madd_epi16(w, x))
#endif

static inline void q8_group(const int16_t *xq, const float *xsc, int K, const int8_t *wg, const float *sg, int m0,
                            int P, float out[][Q8_ROWS]) {
  __m512 acc[Q8_PASS];
  for (int p = 0; p < Q8_PASS; p++) acc[p] = _mm512_setzero_ps();
  const int blocks = K / Q8_BLOCK;
  for (int b = 0; b < blocks; b++) {
    const int8_t *wb = wg + (int64_t)b * Q8_BLOCK * Q8_ROWS;
    __m512i d[Q8_PASS][4];
    for (int p = 0; p < Q8_PASS; p++) d[p][0] = d[p][1] = d[p][2] = d[p][3] = _mm512_setzero_si512();
    q8_prefetch_block(wb, sg, b, P);
    for (int j = 0; j < Q8_BLOCK / 2; j++) {
      q8_prefetch_pair(wb, j, P);
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wb + j * 32)));
      for (int p = 0; p < P; p++) {
        const __m512i x = _mm512_set1_epi32(q8_pair(xq + (int64_t)(m0 + p) * K, b * Q8_BLOCK + 2 * j));
        d[p][j % Q8_CHAINS(P)] = Q8_DOT(d[p][j % Q8_CHAINS(P)], w, x);
      }
    }
    for (int p = 0; p < P; p++)
      for (int c = 1; c < Q8_CHAINS(P); c++) d[p][0] = _mm512_add_epi32(d[p][0], d[p][c]);
    const __m512 s = _mm512_loadu_ps(sg + b * Q8_ROWS);
    for (int p = 0; p < P; p++) {
      const __m512 xs = _mm512_set1_ps(xsc[(int64_t)(m0 + p) * blocks + b]);
      acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[p][0]), _mm512_mul_ps(s, xs), acc[p]);
    }
  }
  for (int p = 0; p < P; p++) _mm512_storeu_ps(out[p], acc[p]);
}

#ifdef __AVX512BF16__
/* bf16 weights by AVX512-BF16 dot products (vdpbf16ps: two bf16 products per fp32 lane, each exact in fp32, fp32
   sums), for up to BF16_DP_ROWS activation rows. x stays near fp32: it is split into hi = bf16(x) and
   lo = bf16(x - hi), ~16 significant bits (relative error ~2^-17, where rounding x to bf16 alone, as llama.cpp's
   BF16 does, costs 2^-9). Each 32 weights then cost two instructions per activation row where fp32 FMAs cost
   four, and the weights are read in their own order (no permute, no widening). At 8 rows the two halves cost as
   many FMA-pipe cycles as fp32 FMAs (Zen 4 runs a 512-bit op as two 256-bit halves), so more rows keep the
   AVX2 loop (measured: 1.35-1.65x at 1-4 rows on one core in cache, 0.94x at 8). */
#define BF16_DP_ROWS 4

/* xs [M, K] fp32 -> hi, lo [M, K] bf16 bit patterns (round to nearest even, as torch's .bfloat16()) */
static void bf16_split(const float *xs, int M, int K, uint16_t *hi, uint16_t *lo) {
  const int64_t n = (int64_t)M * K;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m, xs + i);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  /* exact */
    _mm256_mask_storeu_epi16(hi + i, m, h);
    _mm256_mask_storeu_epi16(lo + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hf)));
  }
}

/* 32 bf16 from p, the ones past `left` zero (a zero weight or activation adds an exact 0) */
INLINE __m512bh bh_load(const uint16_t *p, int left) {
  return (__m512bh)(left >= 32 ? _mm512_loadu_si512((const void *)p)
                               : _mm512_maskz_loadu_epi16((__mmask32)((1ull << left) - 1), p));
}

/* dots[p] = w_row . (hi + lo)[m0 + p] for p < P <= BF16_DP_ROWS */
INLINE void bf16_dots(const uint16_t *hi, const uint16_t *lo, int K, const uint16_t *wr, int m0, int P,
                      float *dots) {
  __m512 ah[BF16_DP_ROWS], al[BF16_DP_ROWS];
  for (int p = 0; p < BF16_DP_ROWS; p++) ah[p] = al[p] = _mm512_setzero_ps();
  for (int k = 0; k < K; k += 32) {
    prefetch_w(wr, k, 1, P);
    const __m512bh w = bh_load(wr + k, K - k);
    for (int p = 0; p < P; p++) {
      const int64_t at = (int64_t)(m0 + p) * K + k;
      ah[p] = _mm512_dpbf16_ps(ah[p], bh_load(hi + at, K - k), w);
      al[p] = _mm512_dpbf16_ps(al[p], bh_load(lo + at, K - k), w);
    }
  }
  for (int p = 0; p < P; p++) dots[p] = _mm512_reduce_add_ps(_mm512_add_ps(ah[p], al[p]));
}

/* one activation row: four accumulators (two 32-blocks a pass), so the dot products' latency overlaps */
INLINE float bf16_dot1(const uint16_t *hi, const uint16_t *lo, int K, const uint16_t *wr) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int k = 0;
  for (; k + 64 <= K; k += 64) {
    prefetch_w(wr, k, 1, 1);
    prefetch_w(wr, k + 32, 1, 1);
    const __m512bh w0 = bh_load(wr + k, 32), w1 = bh_load(wr + k + 32, 32);
    a0 = _mm512_dpbf16_ps(a0, bh_load(hi + k, 32), w0);
    a1 = _mm512_dpbf16_ps(a1, bh_load(lo + k, 32), w0);
    a2 = _mm512_dpbf16_ps(a2, bh_load(hi + k + 32, 32), w1);
    a3 = _mm512_dpbf16_ps(a3, bh_load(lo + k + 32, 32), w1);
  }
  for (; k < K; k += 32) {
    const __m512bh w0 = bh_load(wr + k, K - k);
    a0 = _mm512_dpbf16_ps(a0, bh_load(hi + k, K - k), w0);
    a1 = _mm512_dpbf16_ps(a1, bh_load(lo + k, K - k), w0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

/* rows n0..n1 of y = [res +] [bias +] x @ w.T, x given as its hi and lo halves [M, K], M <= BF16_DP_ROWS */
static void rows_bf16_dp(const uint16_t *hi, const uint16_t *lo, int M, int K, const uint16_t *w, int n0, int n1,
                         int N, const float *bias, const float *res, float *y) {
  float dots[BF16_DP_ROWS];
  for (int n = n0; n < n1; n++) {
    const uint16_t *wr = w + (int64_t)n * K;
    switch (M) {  /* a constant P per call: the compiler keeps the accumulators in registers */
      case 1: dots[0] = bf16_dot1(hi, lo, K, wr); break;
      case 2: bf16_dots(hi, lo, K, wr, 0, 2, dots); break;
      case 3: bf16_dots(hi, lo, K, wr, 0, 3, dots); break;
      default: bf16_dots(hi, lo, K, wr, 0, 4, dots); break;
    }
    store(dots, M, 0, n, N, bias, res, y);
  }
}
#endif
