/* The row loops of the engine's CPU kernel (included by gemv.c, the one compiled unit): small-M products
   y = [residual +] [bias +] prep(x) @ W.T with W fp32, bf16 or int8 (weight-only: the activations and sums stay
   fp32; int8 activations become int16 per block, ~1e-5 relative), and the preps fused before them (RMSNorm,
   SwiGLU). Each thread streams a contiguous run of W's rows front to back (chunks of it, team.h claim), each row
   once for up to 8 activation rows (int8: groups of 16 rows, 2 activation rows a pass, 4 in an AVX-512 build).
   gemv.c runs them as phases of a thread team (prep, product); avx512.h replaces the int8 loop and adds bf16 dot
   products in an AVX-512 build. */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "final_abi.h" /* PREP_* and the weight kinds W_F32, W_Q8, W_BF16 (abi.py) */
#ifndef WIDE
#define WIDE 8 /* activation rows a pass over a weight row */
#endif
#if WIDE < 1 || WIDE > 8
#error "WIDE (activation rows a pass over a weight row) must be 1..8: rows() has loops and dots[] for 8"
#endif
#define Q8_BLOCK 32 /* int8 weights a scale covers */
#ifndef PFHINT
#define PFHINT _MM_HINT_T1 /* into L2, not L1: a batch-1 step 1.15-1.24x (int8), 1.07-1.08x (fp32, bf16) faster than
                              _MM_HINT_T0 on a Zen 4 EPYC (bench/RESULTS.md); T2 about as T1, NTA as T0 */
#endif
#ifndef PREFETCH
#define PREFETCH 4096 /* bytes ahead of the row being read */
#endif
#ifndef Q8_PREFETCH
#define Q8_PREFETCH 8192 /* int8: a byte is a weight, so the same time ahead is more bytes (measured 4096 -> 8192:
                            +5-8% a batch-1 step when the host's memory was fast, the same when it was slow); 0: none,
                            the hardware's prefetcher alone */
#endif

#ifndef PF_PAGE
#define PF_PAGE 1 /* 1: software prefetch only at each 4 KB page of the weight stream (prefetch_page); 0: one per
                     cache line, the distances above ahead */
#endif
#ifndef PF_PAGE_LINES
#define PF_PAGE_LINES 4 /* lines asked for at a page's start (2 and 8 measured no better) */
#endif
#if PREFETCH < 0 || Q8_PREFETCH < 0 || (PF_PAGE != 0 && PF_PAGE != 1) || PF_PAGE_LINES < 1
#error "PREFETCH and Q8_PREFETCH must be >= 0, PF_PAGE 0 or 1, PF_PAGE_LINES >= 1"
#endif
#ifndef PF_PAGE_ROWS
#define PF_PAGE_ROWS 1 /* the most activation rows a pass that prefetches by page: with more, each line costs more
                          work, the core's window reaches fewer lines ahead, and a prefetch per line pays (fp32 batch
                          8 1.5x, int8 1.24x faster than by page) */
#endif

#include "team.h" /* the team's barrier (sync_team) and the phase counters of a -DFINAL_PHASES build */

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* exp for the SiLU: Cephes' polynomial (as in avx_mathfun), relative error ~1e-7 over the clamped range */
static inline __m256 exp256(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, z, x);
  y = _mm256_add_ps(y, one);
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static void prep_norm(const float *x, const float *g, float eps, int K, float *out) {
  __m256 acc = _mm256_setzero_ps();
  int k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 v = _mm256_loadu_ps(x + k);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (; k < K; k++) ss += x[k] * x[k];
  const float r = 1.0f / sqrtf(ss / (float)K + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (k = 0; k + 8 <= K; k += 8)
    _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_loadu_ps(g + k), _mm256_mul_ps(_mm256_loadu_ps(x + k), rv)));
  for (; k < K; k++) out[k] = g[k] * (x[k] * r);
}

static void prep_glu(const float *gate, const float *up, int lo, int hi, float *out) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  int k = lo;
  for (; k + 8 <= hi; k += 8) {
    __m256 a = _mm256_loadu_ps(gate + k);
    __m256 s = _mm256_div_ps(a, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, a))));
    _mm256_storeu_ps(out + k, _mm256_mul_ps(s, _mm256_loadu_ps(up + k)));
  }
  for (; k < hi; k++) out[k] = gate[k] / (1.0f + expf(-gate[k])) * up[k];
}

/* A weight row is fp32 or bf16 (bf = 1: weight-only bf16, the activations and sums fp32), read 16 weights at a
   time as two vectors w0, w1 against x[k..k+8) and x[k+8..k+16). A bf16 is the top half of an fp32, so one
   256-bit load of 16 bf16 gives the odd-indexed 8 exactly as fp32 with an AND, and the even-indexed 8 with a
   16-bit shift: two simple ops per 16 weights, no lane-crossing widen (vpmovzxwd twice was the bottleneck at M=1).
   So for bf16 each 16-block of x is first permuted to its even then its odd elements (bf16_permute, per thread,
   once per product); the scalar tail past the last whole block reads x as it is. `bf` is a literal at every call
   of the always-inlined loops below, so each is compiled once per weight type with no branch inside. */
#define INLINE static inline __attribute__((always_inline))

INLINE void wpair(const void *w, int k, int bf, __m256 *w0, __m256 *w1) {
  if (bf) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k));
    *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *w1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
    return;
  }
  *w0 = _mm256_loadu_ps((const float *)w + k);
  *w1 = _mm256_loadu_ps((const float *)w + k + 8);
}

INLINE float wget(const void *w, int k, int bf) {
  if (bf) {
    union { uint32_t u; float f; } c = {(uint32_t)((const uint16_t *)w)[k] << 16};
    return c.f;
  }
  return ((const float *)w)[k];
}

/* The first lines of a page that begins within [p, p + span). The hardware prefetcher streams a page well once it
   has seen a few of its lines, but stops at each 4 KB page boundary and must find the next page again; asking for
   the next page's first lines ahead of the stream starts it early there. One prefetch per line instead (PF_PAGE=0)
   spends a load slot per line on lines the hardware was fetching anyway: a batch-1 step took 1.08-1.11x as long in
   fp32, 1.02-1.06x in int8, and the kernel streamed ~36 GB/s where the memory gave 48 (bench/RESULTS.md). */
INLINE void prefetch_page(const char *p, int span) {
  const uintptr_t a = (uintptr_t)p, page = (a + 4095) & ~(uintptr_t)4095;
  if (page - a < (uintptr_t)span)
    for (int i = 0; i < PF_PAGE_LINES; i++) _mm_prefetch((const char *)page + 64 * i, PFHINT);
}

/* whether a pass over `rows` activation rows prefetches by page (else one prefetch per line) */
#define BY_PAGE(rows) (PF_PAGE && (rows) <= PF_PAGE_ROWS)

/* the weights' prefetch, called once per 16 weights (a cache line of fp32, half of one of bf16) */
INLINE void prefetch_w(const void *w, int k, int bf, int rows) {
  if (bf && (k & 31)) return;
  const char *ahead = (const char *)w + (int64_t)k * (bf ? 2 : 4) + PREFETCH;
  if (BY_PAGE(rows)) prefetch_page(ahead, 64);
  else _mm_prefetch(ahead, PFHINT);
}

/* xs [M, K] -> out [M, K]: each whole 16-block as its 8 even then its 8 odd elements (the bf16 pair order), the
   tail as it is */
static void bf16_permute(const float *xs, int M, int K, float *out) {
  const __m256i idx = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  for (int m = 0; m < M; m++) {
    const float *x = xs + (int64_t)m * K;
    float *o = out + (int64_t)m * K;
    int k = 0;
    for (; k + 16 <= K; k += 16) {  /* a = x0..7 -> (x0 x2 x4 x6 | x1 x3 x5 x7), b likewise; then swap halves */
      const __m256 a = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + k), idx);
      const __m256 b = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + k + 8), idx);
      _mm256_storeu_ps(o + k, _mm256_permute2f128_ps(a, b, 0x20));
      _mm256_storeu_ps(o + k + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
    for (; k < K; k++) o[k] = x[k];
  }
}

/* the P activation rows m0.. of xs (unused slots point at row m0, so the loops need no bounds) */
INLINE void row_pointers(const float *xs, int K, int m0, int P, int cap, const float **x) {
  for (int p = 0; p < cap; p++) x[p] = xs + (int64_t)(m0 + (p < P ? p : 0)) * K;
}

/* dots[p] = the vector sum sums[p] + the scalar tail of K past k */
INLINE void finish_dots(const __m256 *sums, const float *const *x, int P, int k, int K, const void *wr, int bf,
                        float *dots) {
  for (int p = 0; p < P; p++) {
    float s = hsum(sums[p]);
    for (int kk = k; kk < K; kk++) s += wget(wr, kk, bf) * x[p][kk];
    dots[p] = s;
  }
}

/* dots[p] = w_row . x[m0 + p] for p < P (2 <= P <= 4): one pass over the row, so a thread reads its rows as one
   sequential stream (4 rows side by side were 4 short streams, which the prefetcher served at half the rate) */
INLINE void row_dots(const float *xs, int K, const void *wr, int bf, int m0, int P, float *dots) {
  __m256 a[4][2], sums[4];
  for (int p = 0; p < 4; p++) a[p][0] = a[p][1] = _mm256_setzero_ps();
  const float *x[4];
  row_pointers(xs, K, m0, P, 4, x);
  int k = 0;
  for (; k + 16 <= K; k += 16) {
    prefetch_w(wr, k, bf, P);
    __m256 w0, w1;
    wpair(wr, k, bf, &w0, &w1);
    for (int p = 0; p < P; p++) {
      a[p][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[p] + k), a[p][0]);
      a[p][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[p] + k + 8), a[p][1]);
    }
  }
  for (int p = 0; p < P; p++) sums[p] = _mm256_add_ps(a[p][0], a[p][1]);
  finish_dots(sums, x, P, k, K, wr, bf, dots);
}

/* one activation row: four accumulators (each FMA waits ~4 cycles for its accumulator) */
INLINE float row_dot1(const float *x, int K, const void *wr, int bf) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, w0, w1, w2, w3;
  int k = 0;
  for (; k + 32 <= K; k += 32) {
    prefetch_w(wr, k, bf, 1);
    prefetch_w(wr, k + 16, bf, 1);
    wpair(wr, k, bf, &w0, &w1);
    wpair(wr, k + 16, bf, &w2, &w3);
    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + k + 24), a3);
  }
  for (; k + 16 <= K; k += 16) {
    wpair(wr, k, bf, &w0, &w1);
    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + k + 8), a1);
  }
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < K; k++) s += wget(wr, k, bf) * x[k];
  return s;
}

/* the same for 5..8 activation rows, one accumulator each (8 + the weight pair: 10 of AVX2's 16 registers) */
INLINE void row_dots8(const float *xs, int K, const void *wr, int bf, int m0, int P, float *dots) {
  __m256 a[8];
  for (int p = 0; p < 8; p++) a[p] = _mm256_setzero_ps();
  const float *x[8];
  row_pointers(xs, K, m0, P, 8, x);
  int k = 0;
  for (; k + 16 <= K; k += 16) {
    prefetch_w(wr, k, bf, P);
    __m256 w0, w1;
    wpair(wr, k, bf, &w0, &w1);
    for (int p = 0; p < P; p++)
      a[p] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[p] + k + 8), _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[p] + k), a[p]));
  }
  finish_dots(a, x, P, k, K, wr, bf, dots);
}

static inline void store(const float *dots, int P, int m, int n, int N, const float *bias, const float *res,
                         float *y) {
  for (int p = 0; p < P; p++) {
    const int64_t at = (int64_t)(m + p) * N + n;
    float v = dots[p];
    if (bias) v += bias[n];
    if (res) v = res[at] + v;
    y[at] = v;
  }
}

/* int8 rows: one fp32 scale per block of Q8_BLOCK weights (llama.cpp's Q8_0 block; one scale a row was coarse on
   rows with outliers), K a multiple of Q8_BLOCK and N of Q8_ROWS. The activations come as int16 with a scale per
   block too (quant16_team: 1/32767 of the block's largest magnitude, ~1e-5 relative, where fbgemm's 7-bit
   per-tensor activations cost a KL of 0.24 from fp32), so a block is integer work.
   The weights are stored interleaved (kernels/__init__.py quantize): Q8_ROWS output rows side by side, k in
   pairs, [N / 16][K / 2][16 rows][2], and the scales [N / 16][K / 32][16]. One vector lane is one output row:
   widen a pair of k for 16 rows to int16, multiply-add against the activation pair (x[k], x[k+1]) broadcast, and
   a block's 16 pairs sum in int32 lanes (|sum| <= 32 x 127 x 32767 < 2^31); then one convert and one FMA by the
   16 rows' scales times the activation block's scale. No horizontal sum, no per-row scale broadcast: about half
   the instructions per weight of one row at a time (which left int8 short of the memory's rate). Each group is
   one contiguous stream of 16 K bytes. */
#define Q8_ROWS 16

/* the activation pair (x[k], x[k+1]) as one int32, for a broadcast */
static inline int32_t q8_pair(const int16_t *x, int k) {
  int32_t v;
  __builtin_memcpy(&v, x + k, sizeof v);
  return v;
}

/* int8's prefetch at the start of block b of a group (weights wb, scales sg) for a pass over P rows: by page, the
   weight stream's next page and the scale stream's, which runs at 1/8 its rate */
INLINE void q8_prefetch_block(const int8_t *wb, const float *sg, int b, int P) {
  if (!BY_PAGE(P)) return;
  prefetch_page((const char *)wb + Q8_PREFETCH, Q8_BLOCK * Q8_ROWS);
  prefetch_page((const char *)(sg + b * Q8_ROWS) + Q8_PREFETCH / 8, Q8_ROWS * 4);
}

/* ... and at pair j of the block: else one prefetch per line, Q8_PREFETCH ahead */
INLINE void q8_prefetch_pair(const int8_t *wb, int j, int P) {
  if (!BY_PAGE(P) && Q8_PREFETCH && (j & 1) == 0) _mm_prefetch((const char *)(wb + j * 32) + Q8_PREFETCH, PFHINT);
}

#ifdef __AVX512BW__
#include "avx512.h" /* q8_group in 512-bit registers (Q8_PASS 4); bf16 dot products */
#else
#define Q8_PASS 2 /* activation rows a pass over a group: 2 x 4 accumulators + weights fill AVX2's 16 registers */

/* out[p][0..16) = the 16 rows of group wg (scales sg) . activation row m0 + p, for p < P <= Q8_PASS */
static inline void q8_group(const int16_t *xq, const float *xsc, int K, const int8_t *wg, const float *sg, int m0,
                            int P, float out[][Q8_ROWS]) {
  __m256 lo[Q8_PASS], hi[Q8_PASS];
  for (int p = 0; p < Q8_PASS; p++) lo[p] = hi[p] = _mm256_setzero_ps();
  const int blocks = K / Q8_BLOCK;
  for (int b = 0; b < blocks; b++) {
    const int8_t *wb = wg + (int64_t)b * Q8_BLOCK * Q8_ROWS;
    __m256i d0[Q8_PASS], d1[Q8_PASS];
    for (int p = 0; p < Q8_PASS; p++) d0[p] = d1[p] = _mm256_setzero_si256();
    q8_prefetch_block(wb, sg, b, P);
    for (int j = 0; j < Q8_BLOCK / 2; j++) {
      q8_prefetch_pair(wb, j, P);
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + j * 32)));       /* rows 0-7 */
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + j * 32 + 16)));  /* 8-15 */
      for (int p = 0; p < P; p++) {
        const __m256i x = _mm256_set1_epi32(q8_pair(xq + (int64_t)(m0 + p) * K, b * Q8_BLOCK + 2 * j));
        d0[p] = _mm256_add_epi32(d0[p], _mm256_madd_epi16(w0, x));
        d1[p] = _mm256_add_epi32(d1[p], _mm256_madd_epi16(w1, x));
      }
    }
    const __m256 s0 = _mm256_loadu_ps(sg + b * Q8_ROWS), s1 = _mm256_loadu_ps(sg + b * Q8_ROWS + 8);
    for (int p = 0; p < P; p++) {
      const __m256 xs = _mm256_set1_ps(xsc[(int64_t)(m0 + p) * blocks + b]);
      lo[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0[p]), _mm256_mul_ps(s0, xs), lo[p]);
      hi[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1[p]), _mm256_mul_ps(s1, xs), hi[p]);
    }
  }
  for (int p = 0; p < P; p++) {
    _mm256_storeu_ps(out[p], lo[p]);
    _mm256_storeu_ps(out[p] + 8, hi[p]);
  }
}
#endif

/* one block of Q8_BLOCK activations x -> q int16 and its scale: the block's largest magnitude at 32767 */
static inline void quant16_block(const float *x, int16_t *q, float *sc) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < Q8_BLOCK; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  *sc = amax / 32767.0f;
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
  for (int i = 0; i < Q8_BLOCK; i += 16) {  /* round to nearest, pack 2 x 8 int32 -> 16 int16 in order */
    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), inv));
    _mm256_storeu_si256((__m256i *)(q + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
  }
}

/* xs [M, K] fp32 -> xq int16 and xsc [M, K / Q8_BLOCK], the blocks shared out over the team (ends in a barrier);
   rows are contiguous, so block mb is block mb of the whole matrix */
static void quant16_team(const float *xs, int M, int K, int16_t *xq, float *xsc, Sync *s) {
#pragma omp for schedule(static) nowait
  for (int mb = 0; mb < M * (K / Q8_BLOCK); mb++)
    quant16_block(xs + (int64_t)mb * Q8_BLOCK, xq + (int64_t)mb * Q8_BLOCK, xsc + mb);
  sync_team(s);
}

/* rows n0..n1 of y = [res +] [bias +] xs @ w.T, w fp32 or bf16 (bf: xs then in bf16_permute's order) [N, K] */
INLINE void rows(const float *xs, int M, int K, const void *w, int bf, int n0, int n1, int N, const float *bias,
                 const float *res, float *y) {
  float dots[8];
  for (int n = n0; n < n1; n++) {
    const void *wr = (const char *)w + (int64_t)n * K * (bf ? 2 : 4);
    for (int m = 0; m < M; m += WIDE) {  /* the first pass streams the row, the others find it in L1 */
      const int P = M - m < WIDE ? M - m : WIDE;
      switch (P) {  /* a constant P per call: the compiler keeps the accumulators in registers */
        case 1: dots[0] = row_dot1(xs + (int64_t)m * K, K, wr, bf); break;
        case 2: row_dots(xs, K, wr, bf, m, 2, dots); break;
        case 3: row_dots(xs, K, wr, bf, m, 3, dots); break;
        case 4: row_dots(xs, K, wr, bf, m, 4, dots); break;
        case 5: row_dots8(xs, K, wr, bf, m, 5, dots); break;
        case 6: row_dots8(xs, K, wr, bf, m, 6, dots); break;
        case 7: row_dots8(xs, K, wr, bf, m, 7, dots); break;
        default: row_dots8(xs, K, wr, bf, m, 8, dots); break;
      }
      store(dots, P, m, n, N, bias, res, y);
    }
  }
}

/* groups g0..g1 (Q8_ROWS output rows each) of y = [res +] [bias +] x @ w.T, w int8 interleaved (see q8_group) with
   its scales, the activations quantized (quant16_team) */
static void rows_q8(const int16_t *xq, const float *xsc, int M, int K, const int8_t *w, const float *scale, int g0,
                    int g1, int N, const float *bias, const float *res, float *y) {
  float out[Q8_PASS][Q8_ROWS];
  for (int g = g0; g < g1; g++) {
    const int8_t *wg = w + (int64_t)g * Q8_ROWS * K;
    const float *sg = scale + (int64_t)g * Q8_ROWS * (K / Q8_BLOCK);
    for (int m = 0; m < M; m += Q8_PASS) {  /* the first pass streams the group, the others find it in L1/L2 */
      const int P = M - m < Q8_PASS ? M - m : Q8_PASS;
      switch (P) {  /* a constant P per call: the compiler keeps the accumulators in registers */
        case 1: q8_group(xq, xsc, K, wg, sg, m, 1, out); break;
        case 2: q8_group(xq, xsc, K, wg, sg, m, 2, out); break;
#if Q8_PASS > 2
        case 3: q8_group(xq, xsc, K, wg, sg, m, 3, out); break;
        default: q8_group(xq, xsc, K, wg, sg, m, 4, out); break;
#endif
      }
      for (int i = 0; i < Q8_ROWS; i++) {
        float dots[Q8_PASS];
        for (int p = 0; p < P; p++) dots[p] = out[p][i];
        store(dots, P, m, g * Q8_ROWS + i, N, bias, res, y);
      }
    }
  }
}
