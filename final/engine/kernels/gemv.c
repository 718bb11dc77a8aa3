/* The embedded engine's small-M fp32 matrix product for decode: y = [residual +] [bias +] prep(x) @ W.T

   Batch-1..8 decode streams every weight once per step, so its speed is memory bandwidth. torch's CPU kernels
   reach 11 (MKL, dense) to 20 GB/s (oneDNN, packed) at M=1 on a 2-core AVX2 EPYC; this loop streams W in its
   ordinary row-major layout [N, K] (so prefill's F.linear reads the same tensor: one copy of the model), each
   thread a contiguous run of rows, 4 rows x 2 activation rows a pass (8 AVX2 accumulators; a 4-row block stays in
   L1 while every activation row reads it). bench/gemv.py measures it beside torch's kernels.

   prep, done once per call inside the same parallel region (so a decode layer is 4 calls, not ~12 torch ops):
     PREP_NONE  x as given, [M, K]
     PREP_NORM  RMSNorm of x with weight g (HF's fp32 order: x * rsqrt(mean(x^2) + eps), then * g), [M, K]
     PREP_GLU   silu(x[:, :K]) * x[:, K:] from the fused gate|up product, x [M, 2K]

   Built by final/engine/kernels/__init__.py with the system gcc (-O3 -mavx2 -mfma -fopenmp); its OpenMP is the
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
#ifndef PFHINT
#define PFHINT _MM_HINT_T0
#endif
#ifndef PREFETCH
#define PREFETCH 4096 /* bytes ahead of the row being read */
#endif

int final_gemv_abi(void) { return 2; }

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

/* dots[p] = w_row . x[m0 + p] for p < P (P <= 4): one pass over the row, so a thread reads its rows as one
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

static void rows(const float *xs, int M, int K, const float *w, int n0, int n1, int N, const float *bias,
                 const float *res, float *y) {
  float dots[8];
  for (int n = n0; n < n1; n++) {
    const float *wr = w + (int64_t)n * K;
    for (int m = 0; m < M; m += WIDE) {  /* the first pass streams the row, the others find it in L1 */
      const int P = M - m < WIDE ? M - m : WIDE;
      switch (P) {  /* a constant P per call: the compiler keeps the accumulators in registers */
        case 1: row_dots(xs, K, wr, m, 1, dots); break;
        case 2: row_dots(xs, K, wr, m, 2, dots); break;
        case 3: row_dots(xs, K, wr, m, 3, dots); break;
        case 4: row_dots(xs, K, wr, m, 4, dots); break;
        case 5: row_dots8(xs, K, wr, m, 5, dots); break;
        case 6: row_dots8(xs, K, wr, m, 6, dots); break;
        case 7: row_dots8(xs, K, wr, m, 7, dots); break;
        default: row_dots8(xs, K, wr, m, 8, dots); break;
      }
      for (int p = 0; p < P; p++) {
        const int64_t at = (int64_t)(m + p) * N + n;
        float v = dots[p];
        if (bias) v += bias[n];
        if (res) v = res[at] + v;
        y[at] = v;
      }
    }
  }
}

/* x [M, Kx] (Kx = 2K for PREP_GLU), w [N, K], bias [N] or NULL, res [M, N] or NULL, g [K] (PREP_NORM), y [M, N];
   scratch [M, K] when prep != PREP_NONE. All contiguous fp32. */
void final_gemv(const float *x, int M, int K, const float *w, int N, const float *bias, const float *res,
                int prep, const float *g, float eps, float *scratch, float *y) {
  const float *xs = prep == PREP_NONE ? x : scratch;
  const int blocks = N;
#pragma omp parallel
  {
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
    /* the implicit barrier of the omp for above: every prepared row is written before any is read */
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    const int b0 = (int)((int64_t)blocks * t / T), b1 = (int)((int64_t)blocks * (t + 1) / T);
    const int n0 = b0, n1 = b1;
    if (n0 < n1) rows(xs, M, K, w, n0, n1, N, bias, res, y);
  }
}
