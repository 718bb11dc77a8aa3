/* The embedded engine's decode on CPU: small-M products y = [residual +] [bias +] prep(x) @ W.T, W fp32 or int8
   (one scale per 32 weights; activations stay fp32: weight-only quantization), and whole decoder layers built
   from them (final_decode_layers, at the end: RMSNorm, q|k|v, RoPE, cache write, attention, o, SwiGLU, down).

   Batch-1..8 decode streams every weight once per step, so its speed is memory bandwidth. torch's CPU kernels
   reach 11 (MKL, dense) to 20 GB/s (oneDNN, packed) at M=1 on a 2-core AVX2 EPYC; this loop streams W in its
   ordinary row-major layout [N, K] (so prefill's F.linear reads the same tensor: one copy of the model), each
   thread a contiguous run of rows read front to back with a software prefetch ahead, each row once for up to 8
   activation rows (the row stays in L1 for a second pass above 8). bench/gemv.py measures it beside torch's.

   prep, done once per call inside the same parallel region:
     PREP_NONE  x as given, [M, K]
     PREP_NORM  RMSNorm of x with weight g (HF's fp32 order: x * rsqrt(mean(x^2) + eps), then * g), [M, K]
     PREP_GLU   silu(x[:, :K]) * x[:, K:] from the fused gate|up product, x [M, 2K]

   Built by final/engine/kernels/__init__.py with the system gcc (-O3 -mavx2 -mfma -fopenmp, no FP contraction
   outside the explicit FMAs, so RoPE is torch's bitwise); its OpenMP is the
   libgomp torch already loaded (same soname), so it shares torch's thread pool and torch.set_num_threads. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

enum { PREP_NONE = 0, PREP_NORM = 1, PREP_GLU = 2 };
#ifndef WIDE
#define WIDE 8 /* activation rows a pass over a weight row */
#endif
#define Q8_BLOCK 32 /* int8 weights a scale covers */
#ifndef PFHINT
#define PFHINT _MM_HINT_T0
#endif
#ifndef PREFETCH
#define PREFETCH 4096 /* bytes ahead of the row being read */
#endif

int final_gemv_abi(void) { return 7; }

int final_gemv_cpu_ok(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

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

/* dots[p] = w_row . x[m0 + p] for p < P (2 <= P <= 4): one pass over the row, so a thread reads its rows as one
   sequential stream (4 rows side by side were 4 short streams, which the prefetcher served at half the rate) */
static inline void row_dots(const float *xs, int K, const float *wr, int m0, int P, float *dots) {
  __m256 a[4][2];
  for (int p = 0; p < 4; p++) a[p][0] = a[p][1] = _mm256_setzero_ps();
  const float *x[4];
  for (int p = 0; p < 4; p++) x[p] = xs + (int64_t)(m0 + (p < P ? p : 0)) * K;
  int k = 0;
  for (; k + 16 <= K; k += 16) {
    _mm_prefetch((const char *)(wr + k) + PREFETCH, PFHINT);
    const __m256 w0 = _mm256_loadu_ps(wr + k), w1 = _mm256_loadu_ps(wr + k + 8);
    for (int p = 0; p < P; p++) {
      a[p][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[p] + k), a[p][0]);
      a[p][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[p] + k + 8), a[p][1]);
    }
  }
  for (int p = 0; p < P; p++) {
    float s = hsum(_mm256_add_ps(a[p][0], a[p][1]));
    for (int kk = k; kk < K; kk++) s += wr[kk] * x[p][kk];
    dots[p] = s;
  }
}

/* one activation row: four accumulators (each FMA waits ~4 cycles for its accumulator) */
static inline float row_dot1(const float *x, int K, const float *wr) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int k = 0;
  for (; k + 32 <= K; k += 32) {
    _mm_prefetch((const char *)(wr + k) + PREFETCH, PFHINT);
    _mm_prefetch((const char *)(wr + k) + 64 + PREFETCH, PFHINT);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + k), _mm256_loadu_ps(x + k), a0);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < K; k++) s += wr[k] * x[k];
  return s;
}

/* the same for 5..8 activation rows, one accumulator each (8 + the weight: the registers AVX2 has) */
static inline void row_dots8(const float *xs, int K, const float *wr, int m0, int P, float *dots) {
  __m256 a[8];
  for (int p = 0; p < 8; p++) a[p] = _mm256_setzero_ps();
  const float *x[8];
  for (int p = 0; p < 8; p++) x[p] = xs + (int64_t)(m0 + (p < P ? p : 0)) * K;
  int k = 0;
  for (; k + 8 <= K; k += 8) {
    _mm_prefetch((const char *)(wr + k) + PREFETCH, PFHINT);
    const __m256 wv = _mm256_loadu_ps(wr + k);
    for (int p = 0; p < P; p++) a[p] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[p] + k), a[p]);
  }
  for (int p = 0; p < P; p++) {
    float s = hsum(a[p]);
    for (int kk = k; kk < K; kk++) s += wr[kk] * x[p][kk];
    dots[p] = s;
  }
}

/* 8 int8 weights from k, widened to fp32 */
static inline __m256 q8load(const int8_t *w, int k) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + k))));
}

/* int8 rows: one fp32 scale per block of Q8_BLOCK weights (llama.cpp's Q8_0 block; one scale a row was coarse on
   rows with outliers), K a multiple of Q8_BLOCK. The activations come as int16 with a scale per block too
   (quant16_team: 1/32767 of the block's largest magnitude, ~1e-5 relative, where fbgemm's 7-bit per-tensor
   activations cost a KL of 0.24 from fp32), so a block is integer work: widen 32 weights to int16, two
   vpmaddwd against the activations (|sum| <= 4 x 127 x 32767 < 2^31 per lane: no overflow), one convert and one
   FMA by the two scales. Widening each weight to fp32 instead cost 10 FP instructions a block and made one core
   compute-bound. P <= 4 activation rows. */
static inline void q8_dots(const int16_t *xq, const float *xsc, int K, const int8_t *wr, const float *sr, int m0,
                           int P, float *dots) {
  __m256 a[4];
  for (int p = 0; p < 4; p++) a[p] = _mm256_setzero_ps();
  const int blocks = K / Q8_BLOCK;
  for (int b = 0; b < blocks; b++) {
    const int k = b * Q8_BLOCK;
    if ((k & 63) == 0) _mm_prefetch((const char *)(wr + k) + PREFETCH, PFHINT);
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + k)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + k + 16)));
    for (int p = 0; p < P; p++) {
      const int16_t *x = xq + (int64_t)(m0 + p) * K + k;
      const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x)),
                                         _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16))));
      const __m256 s = _mm256_set1_ps(sr[b] * xsc[(int64_t)(m0 + p) * blocks + b]);
      a[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, a[p]);
    }
  }
  for (int p = 0; p < P; p++) dots[p] = hsum(a[p]);
}

/* xs [M, K] fp32 -> xq int16 and xsc [M, K / Q8_BLOCK]: each block scaled to its largest magnitude at 32767 */
static void quant16_team(const float *xs, int M, int K, int16_t *xq, float *xsc) {
  const int blocks = K / Q8_BLOCK;
  const __m256 sign = _mm256_set1_ps(-0.0f);
#pragma omp for schedule(static)
  for (int mb = 0; mb < M * blocks; mb++) {
    const float *x = xs + (int64_t)mb * Q8_BLOCK;  /* rows are contiguous, so block mb of the whole matrix */
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < Q8_BLOCK; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    xsc[mb] = amax / 32767.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    int16_t *q = xq + (int64_t)mb * Q8_BLOCK;
    for (int i = 0; i < Q8_BLOCK; i += 16) {  /* round to nearest, pack 2 x 8 int32 -> 16 int16 in order */
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), inv));
      _mm256_storeu_si256((__m256i *)(q + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
    }
  }
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

/* rows n0..n1 of y = [res +] [bias +] xs @ w.T, w fp32 [N, K] */
static void rows(const float *xs, int M, int K, const float *w, int n0, int n1, int N, const float *bias,
                 const float *res, float *y) {
  float dots[8];
  for (int n = n0; n < n1; n++) {
    const float *wr = w + (int64_t)n * K;
    for (int m = 0; m < M; m += WIDE) {  /* the first pass streams the row, the others find it in L1 */
      const int P = M - m < WIDE ? M - m : WIDE;
      switch (P) {  /* a constant P per call: the compiler keeps the accumulators in registers */
        case 1: dots[0] = row_dot1(xs + (int64_t)m * K, K, wr); break;
        case 2: row_dots(xs, K, wr, m, 2, dots); break;
        case 3: row_dots(xs, K, wr, m, 3, dots); break;
        case 4: row_dots(xs, K, wr, m, 4, dots); break;
        case 5: row_dots8(xs, K, wr, m, 5, dots); break;
        case 6: row_dots8(xs, K, wr, m, 6, dots); break;
        case 7: row_dots8(xs, K, wr, m, 7, dots); break;
        default: row_dots8(xs, K, wr, m, 8, dots); break;
      }
      store(dots, P, m, n, N, bias, res, y);
    }
  }
}

/* the same with w int8 [N, K] and scale [N, K / Q8_BLOCK], the activations quantized (quant16_team) */
static void rows_q8(const int16_t *xq, const float *xsc, int M, int K, const int8_t *w, const float *scale, int n0,
                    int n1, int N, const float *bias, const float *res, float *y) {
  float dots[4];
  const int blocks = K / Q8_BLOCK;
  for (int n = n0; n < n1; n++) {
    const int8_t *wr = w + (int64_t)n * K;
    const float *sr = scale + (int64_t)n * blocks;
    for (int m = 0; m < M; m += 4) {
      const int P = M - m < 4 ? M - m : 4;
      switch (P) {
        case 1: q8_dots(xq, xsc, K, wr, sr, m, 1, dots); break;
        case 2: q8_dots(xq, xsc, K, wr, sr, m, 2, dots); break;
        case 3: q8_dots(xq, xsc, K, wr, sr, m, 3, dots); break;
        default: q8_dots(xq, xsc, K, wr, sr, m, 4, dots); break;
      }
      store(dots, P, m, n, N, bias, res, y);
    }
  }
}

/* int8 products' activations, quantized once per product: [M, max K] int16 and their block scales */
typedef struct {
  int16_t *xq;
  float *xsc;
} Q16;

static Q16 q16_alloc(int M, int K) {
  Q16 q = {malloc(sizeof(int16_t) * (size_t)M * K), malloc(sizeof(float) * (size_t)M * (K / Q8_BLOCK + 1))};
  return q;
}

static void q16_free(Q16 q) {
  free(q.xq);
  free(q.xsc);
}

/* ---- the phases, each run by every thread of an enclosing parallel region (worksharing inside) ---- */

/* scratch = prep(x): RMSNorm of each row [M, K], or SwiGLU of gate|up [M, 2K] -> [M, K]; ends in a barrier */
static void prep_team(const float *x, int M, int K, int prep, const float *g, float eps, float *scratch) {
  if (prep == PREP_NORM) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++) prep_norm(x + (int64_t)m * K, g, eps, K, scratch + (int64_t)m * K);
  } else if (prep == PREP_GLU) {
    const int chunks = (K + 63) / 64;
#pragma omp for schedule(static) collapse(2)
    for (int m = 0; m < M; m++)
      for (int c = 0; c < chunks; c++) {
        const int lo = c * 64, hi = lo + 64 < K ? lo + 64 : K;
        prep_glu(x + (int64_t)m * 2 * K, x + (int64_t)m * 2 * K + K, lo, hi, scratch + (int64_t)m * K);
      }
  }
}

/* y = [res +] [bias +] xs @ w.T, this thread's contiguous share of the N output rows; int8 (scale set) first
   quantizes xs into q with the whole team (a barrier). No barrier after (res may be y: each element is read,
   then written, by the thread that owns its row); the caller's barrier must come before q is used again. */
static void product_team(const float *xs, int M, int K, const void *w, const float *scale, int N, const float *bias,
                         const float *res, float *y, Q16 q) {
  if (scale) quant16_team(xs, M, K, q.xq, q.xsc);
  const int t = omp_get_thread_num(), T = omp_get_num_threads();
  const int n0 = (int)((int64_t)N * t / T), n1 = (int)((int64_t)N * (t + 1) / T);
  if (n0 >= n1) return;
  if (scale) rows_q8(q.xq, q.xsc, M, K, (const int8_t *)w, scale, n0, n1, N, bias, res, y);
  else rows(xs, M, K, (const float *)w, n0, n1, N, bias, res, y);
}

/* x [M, Kx] (Kx = 2K for PREP_GLU), w [N, K] fp32 (scale NULL) or int8 (scale [N, K/32] fp32), bias [N] or NULL,
   res [M, N] or NULL, g [K] (PREP_NORM), y [M, N]; scratch [M, K] when prep != PREP_NONE. Contiguous. */
void final_gemv(const float *x, int M, int K, const void *w, const float *scale, int N, const float *bias,
                const float *res, int prep, const float *g, float eps, float *scratch, float *y) {
  Q16 q = {NULL, NULL};
  if (scale) q = q16_alloc(M, K);
#pragma omp parallel
  {
    prep_team(x, M, K, prep, g, eps, scratch);  /* its barrier: every prepared row is written before any is read */
    product_team(prep == PREP_NONE ? x : scratch, M, K, w, scale, N, bias, res, y, q);
  }
  if (scale) q16_free(q);
}

/* ---- decode attention: RoPE, the K/V cache write and attention of one new token per row ----
   qkv [B, (H + 2 Hkv) D] (the fused product, before RoPE), cos/sin_signed [B, D] (HF's tables at each row's
   position, sin's first half negated: rope(x) = x cos + roll(x, D/2) sin_signed, as final/engine/model.py),
   kc/vc one layer's cache [rows, Hkv, T, D], lengths [B] (tokens row b has cached; the new one goes there),
   out [B, H D]. What ~14 torch ops a layer did (rope, two index_puts, matmul, scale, mask, softmax, matmul). */
static void rope_head(const float *x, const float *cos, const float *sin, int D, float *out) {
  const int half = D / 2;
  for (int d = 0; d < D; d++) {
    const float rolled = x[d < half ? d + half : d - half];
    out[d] = x[d] * cos[d] + rolled * sin[d]; /* two products, then the sum: torch's order (no FMA contraction) */
  }
}

static inline float dot(const float *a, const float *b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

static void attend_team(const float *qkv, int B, int H, int Hkv, int D, const float *cos, const float *sin,
                        float *kc, float *vc, int64_t T, const int64_t *lengths, float scale, float *out) {
  const int64_t width = (int64_t)(H + 2 * Hkv) * D, G = H / Hkv;
#pragma omp for schedule(static)
  for (int task = 0; task < B * Hkv; task++) {
    const int b = task / Hkv, g = task % Hkv;
    const float *row = qkv + b * width;
    const int64_t at = (((int64_t)b * Hkv + g) * T + lengths[b]) * D;
    rope_head(row + (int64_t)(H + g) * D, cos + (int64_t)b * D, sin + (int64_t)b * D, D, kc + at);
    for (int d = 0; d < D; d++) vc[at + d] = row[(int64_t)(H + Hkv + g) * D + d];
  }
  /* the barrier above: every new K/V is in the cache before any row attends */
  float *q = malloc(sizeof(float) * D), *o = malloc(sizeof(float) * D), *s = NULL;
  int64_t s_len = 0;
#pragma omp for schedule(static)
  for (int task = 0; task < B * H; task++) {
    const int b = task / H, h = task % H, g = h / G;
    const int64_t n = lengths[b] + 1;
    if (n > s_len) {
      free(s);
      s = malloc(sizeof(float) * n);
      s_len = n;
    }
    rope_head(qkv + b * width + (int64_t)h * D, cos + (int64_t)b * D, sin + (int64_t)b * D, D, q);
    const float *K = kc + ((int64_t)b * Hkv + g) * T * D, *V = vc + ((int64_t)b * Hkv + g) * T * D;
    float m = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < n; t++) {
      s[t] = dot(q, K + t * D, D) * scale;
      m = s[t] > m ? s[t] : m;
    }
    for (int64_t t = 0; t < n; t++) {
      s[t] = expf(s[t] - m);
      sum += s[t];
    }
    for (int d = 0; d < D; d++) o[d] = 0.0f;
    for (int64_t t = 0; t < n; t++) {
      const float p = s[t] / sum;
      const float *v = V + t * D;
      for (int d = 0; d < D; d++) o[d] += p * v[d];
    }
    for (int d = 0; d < D; d++) out[(int64_t)b * H * D + (int64_t)h * D + d] = o[d];
  }
  free(q);
  free(o);
  free(s);
}

/* ---- whole decoder layers: every layer of a decode step in one call and one parallel region ----
   x [M, hidden] is the residual stream, updated in place. Per layer, a row of `wtab` holds (as int64 addresses)
   wqkv, wo, wgu, wd (fp32, or int8 with the 4 scales next), their scales or 0, the qkv bias or 0, in_norm,
   post_norm; `ctab` its K and V cache. work: [M, (H + 2 Hkv) D + H D + max(hidden, inter) + 2 inter] floats.
   What the torch forward does with ~10 calls and ~8 parallel regions a layer, with a barrier between phases. */
enum { W_QKV, W_O, W_GU, W_D, S_QKV, S_O, S_GU, S_D, B_QKV, N_IN, N_POST, W_FIELDS };

void final_decode_layers(float *x, int M, int hidden, int inter, int H, int Hkv, int D, int layers,
                         const int64_t *wtab, const int64_t *ctab, const float *cos, const float *sin, int64_t T,
                         const int64_t *lengths, float scale, float eps, float *work) {
  const int nqkv = (H + 2 * Hkv) * D, big = hidden > inter ? hidden : inter;
  float *qkv = work, *att = qkv + (int64_t)M * nqkv, *h = att + (int64_t)M * H * D, *gu = h + (int64_t)M * big;
  const int q8 = wtab[S_QKV] != 0;  /* every layer's matrices are of one kind */
  Q16 q = {NULL, NULL};
  if (q8) q = q16_alloc(M, big > H * D ? big : H * D);  /* the largest input a product quantizes */
#pragma omp parallel
  for (int l = 0; l < layers; l++) {
    const int64_t *w = wtab + (int64_t)l * W_FIELDS;
#define F(i) ((const float *)(intptr_t)w[i])
    prep_team(x, M, hidden, PREP_NORM, F(N_IN), eps, h);
    product_team(h, M, hidden, (const void *)(intptr_t)w[W_QKV], F(S_QKV), nqkv, F(B_QKV), NULL, qkv, q);
#pragma omp barrier
    attend_team(qkv, M, H, Hkv, D, cos, sin, (float *)(intptr_t)ctab[2 * l], (float *)(intptr_t)ctab[2 * l + 1],
                T, lengths, scale, att);
    product_team(att, M, H * D, (const void *)(intptr_t)w[W_O], F(S_O), hidden, NULL, x, x, q);
#pragma omp barrier
    prep_team(x, M, hidden, PREP_NORM, F(N_POST), eps, h);
    product_team(h, M, hidden, (const void *)(intptr_t)w[W_GU], F(S_GU), 2 * inter, NULL, NULL, gu, q);
#pragma omp barrier
    prep_team(gu, M, inter, PREP_GLU, NULL, 0.0f, h);
    product_team(h, M, inter, (const void *)(intptr_t)w[W_D], F(S_D), hidden, NULL, x, x, q);
#pragma omp barrier
#undef F
  }
  if (q8) q16_free(q);
}
