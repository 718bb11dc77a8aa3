/* The embedded engine's decode on CPU: small-M products y = [residual +] [bias +] prep(x) @ W.T with W fp32, bf16
   or int8 (products.h), and whole decoder layers built from them (final_decode_layers, at the end: RMSNorm,
   q|k|v, RoPE, cache write, attention, o, SwiGLU, down).

   Batch-1..8 decode streams every weight once per step, so its speed is memory bandwidth. torch's CPU kernels
   reach 11 (MKL, dense) to 20 GB/s (oneDNN, packed) at M=1 on a 2-core AVX2 EPYC; these loops stream W in its
   ordinary row-major layout [N, K] (so prefill's F.linear reads the same tensor: one copy of the model), each
   thread a contiguous run of rows read front to back with a software prefetch ahead. bench/gemv.py measures
   them beside torch's.

   prep, done once per call inside the same parallel region:
     PREP_NONE  x as given, [M, K]
     PREP_NORM  RMSNorm of x with weight g (HF's fp32 order: x * rsqrt(mean(x^2) + eps), then * g), [M, K]
     PREP_GLU   silu(x[:, :K]) * x[:, K:] from the fused gate|up product, x [M, 2K]

   Built by final/engine/kernels/__init__.py with the system gcc (-O3 -mavx2 -mfma -fopenmp, no FP contraction
   outside the explicit FMAs, so RoPE is torch's bitwise); its OpenMP is the
   libgomp torch already loaded (same soname), so it shares torch's thread pool and torch.set_num_threads. */
#include "products.h"

/* a product's activations as its weight kind reads them, in buffers of one call: int8's [M, max K] int16 and block
   scales, made by the team once per product (xq, xsc); and per thread (the next region's team, `stride` floats
   each): bf16's x in the order its loop reads (xp), the thread's own normed rows (hp) and their int8 (xqp, xscp)
   for products whose thread prepares its input itself (normed_product) */
typedef struct {
  int16_t *xq, *xqp;
  float *xsc, *xp, *hp, *xscp;
  int64_t stride;  /* M K: floats per thread in xp and hp, int16 per thread in xqp */
  Sync *sync;      /* the team's barrier */
} Acts;

static int64_t scale_stride(Acts a, int M) { return a.stride / Q8_BLOCK + M; }  /* floats per thread in xscp */

/* priv: the per-thread normed rows (and their int8) normed_product uses */
static Acts acts_alloc(int kind, int M, int K, int priv) {
  const size_t T = (size_t)omp_get_max_threads(), n = (size_t)M * K;
  Acts a = {NULL, NULL, NULL, NULL, NULL, NULL, (int64_t)n, malloc(sizeof(Sync))};
  if (priv) a.hp = malloc(sizeof(float) * n * T);
  if (kind == W_Q8) {
    a.xq = malloc(sizeof(int16_t) * n);
    a.xsc = malloc(sizeof(float) * M * (K / Q8_BLOCK + 1));
    if (priv) {
      a.xqp = malloc(sizeof(int16_t) * n * T);
      a.xscp = malloc(sizeof(float) * scale_stride(a, M) * T);
    }
  } else if (kind == W_BF16) {
    a.xp = malloc(sizeof(float) * n * T);
  }
  return a;
}

/* this thread's bf16 buffer (NULL for the other kinds) */
static float *thread_xp(Acts a) { return a.xp ? a.xp + a.stride * omp_get_thread_num() : NULL; }

static void acts_free(Acts a) {
  free(a.xq);
  free(a.xqp);
  free(a.xsc);
  free(a.xp);
  free(a.hp);
  free(a.xscp);
  free(a.sync);
}

/* ---- the phases, each run by every thread of an enclosing parallel region (worksharing inside) ---- */

/* scratch = prep(x): RMSNorm of each row [M, K], or SwiGLU of gate|up [M, 2K] -> [M, K]; ends in a barrier. With
   xq (int8 products: K a multiple of Q8_BLOCK) the SwiGLU's output is also quantized into xq/xsc as it is made, so
   the product after it needs no quantizing phase (and no barrier) of its own. */
static void prep_team(const float *x, int M, int K, int prep, const float *g, float eps, float *scratch,
                      int16_t *xq, float *xsc, Sync *s) {
  if (prep == PREP_NORM) {
#pragma omp for schedule(static) nowait
    for (int m = 0; m < M; m++) prep_norm(x + (int64_t)m * K, g, eps, K, scratch + (int64_t)m * K);
    sync_team(s);
  } else if (prep == PREP_GLU) {
    const int chunks = (K + 63) / 64;
#pragma omp for schedule(static) collapse(2) nowait
    for (int m = 0; m < M; m++)
      for (int c = 0; c < chunks; c++) {
        const int lo = c * 64, hi = lo + 64 < K ? lo + 64 : K;
        prep_glu(x + (int64_t)m * 2 * K, x + (int64_t)m * 2 * K + K, lo, hi, scratch + (int64_t)m * K);
        for (int k = lo; xq && k < hi; k += Q8_BLOCK) {  /* 64 is two whole blocks */
          const int64_t at = (int64_t)m * K + k;
          quant16_block(scratch + at, xq + at, xsc + at / Q8_BLOCK);
        }
      }
    sync_team(s);
  }
}

/* this thread's contiguous share of the N output rows of y = [res +] [bias +] xs @ w.T, w of `kind` (W_F32, W_BF16,
   or W_Q8 with its block scales, reading xs as xq/xsc); xp: the thread's bf16 buffer. No barrier after (res may be
   y: each element is read, then written, by the thread that owns its row). */
static void product_rows(const float *xs, const int16_t *xq, const float *xsc, int M, int K, const void *w,
                         int kind, const float *scale, int N, const float *bias, const float *res, float *y,
                         float *xp) {
  const int t = omp_get_thread_num(), T = omp_get_num_threads();
  if (kind == W_Q8) {  /* whole groups of Q8_ROWS rows */
    const int groups = N / Q8_ROWS, g0 = (int)((int64_t)groups * t / T), g1 = (int)((int64_t)groups * (t + 1) / T);
    if (g0 < g1) rows_q8(xq, xsc, M, K, (const int8_t *)w, scale, g0, g1, N, bias, res, y);
    return;
  }
  const int n0 = (int)((int64_t)N * t / T), n1 = (int)((int64_t)N * (t + 1) / T);
  if (n0 >= n1) return;
  if (kind == W_BF16) {
#ifdef __AVX512BF16__
    if (M <= BF16_DP_ROWS) {
      uint16_t *hi = (uint16_t *)xp, *lo = hi + (int64_t)M * K;  /* 2 M K bf16: the M K floats xp holds */
      bf16_split(xs, M, K, hi, lo);
      rows_bf16_dp(hi, lo, M, K, (const uint16_t *)w, n0, n1, N, bias, res, y);
      return;
    }
#endif
    bf16_permute(xs, M, K, xp);
    rows(xp, M, K, w, 1, n0, n1, N, bias, res, y);
  } else {
    rows(xs, M, K, w, 0, n0, n1, N, bias, res, y);
  }
}

/* the team's product of xs (the whole team's input, written before a barrier): int8 first quantizes xs into `a`
   with the whole team (a barrier) unless `quantized` (prep_team did). The caller's barrier must come before `a`
   is written again. */
static void product_team(const float *xs, int M, int K, const void *w, int kind, const float *scale, int N,
                         const float *bias, const float *res, float *y, Acts a, int quantized) {
  if (kind == W_Q8 && !quantized) quant16_team(xs, M, K, a.xq, a.xsc, a.sync);
  product_rows(xs, a.xq, a.xsc, M, K, w, kind, scale, N, bias, res, y, thread_xp(a));
}

#ifndef PRIVATE_ROWS
#define PRIVATE_ROWS 4
#endif
/* y = [bias +] RMSNorm(x) @ w.T with each thread norming (and for int8 quantizing) all M rows itself, in its own
   buffers: no barrier before its share of the product. For M <= PRIVATE_ROWS, doing a few rows' norm on every
   thread costs less than the two barriers (norm, quantize) of preparing them once for the team. */
static void normed_product(const float *x, int M, int K, const float *g, float eps, const void *w, int kind,
                           const float *scale, int N, const float *bias, float *y, Acts a) {
  const int t = omp_get_thread_num();
  float *h = a.hp + a.stride * t;
  for (int m = 0; m < M; m++) prep_norm(x + (int64_t)m * K, g, eps, K, h + (int64_t)m * K);
  int16_t *xq = NULL;
  float *xsc = NULL;
  if (kind == W_Q8) {
    const int64_t blocks = (int64_t)M * (K / Q8_BLOCK);
    xq = a.xqp + a.stride * t;
    xsc = a.xscp + scale_stride(a, M) * t;
    for (int64_t mb = 0; mb < blocks; mb++) quant16_block(h + mb * Q8_BLOCK, xq + mb * Q8_BLOCK, xsc + mb);
  }
  product_rows(h, xq, xsc, M, K, w, kind, scale, N, bias, NULL, y, thread_xp(a));
}

int final_gemv_abi(void) { return 10; }

/* out [PHASE_THREADS][2][PHASES]: the cycles FINAL_PHASES counted since the last call (then zeroed); returns
   PHASES, or 0 in a build without them */
int final_phase_cycles(uint64_t *out) {
#ifdef FINAL_PHASES
  __builtin_memcpy(out, phase_cycles, sizeof phase_cycles);
  __builtin_memset(phase_cycles, 0, sizeof phase_cycles);
  return PHASES;
#else
  (void)out;
  return 0;
#endif
}

/* whether this CPU runs every instruction set this build was compiled for (a build for a larger set than the CPU
   has is refused before any of its loops runs) */
int final_gemv_cpu_ok(void) {
  __builtin_cpu_init();
  int ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#ifdef __AVX512BW__
  ok = ok && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
#ifdef __AVX512BF16__
  ok = ok && __builtin_cpu_supports("avx512bf16");
#endif
  return ok;
}

/* int8 weights in the interleaved order (products.h q8_group) -> the fp32 [N, K] row-major weight they stand for,
   for products with more rows than the kernel takes (oneDNN over it). Each group's 16 K bytes stay in L1 while its
   16 rows are written; the same product as torch's (an int8 widens exactly; one rounding), bit for bit. */
void final_q8_dequantize(const int8_t *q, const float *scale, int N, int K, float *out) {
  const int groups = N / Q8_ROWS, blocks = K / Q8_BLOCK;
#pragma omp parallel for schedule(static)
  for (int g = 0; g < groups; g++) {
    const int8_t *wg = q + (int64_t)g * Q8_ROWS * K;
    const float *sg = scale + (int64_t)g * Q8_ROWS * blocks;
    for (int r = 0; r < Q8_ROWS; r++) {
      float *o = out + ((int64_t)g * Q8_ROWS + r) * K;
      for (int b = 0; b < blocks; b++) {
        const float s = sg[b * Q8_ROWS + r];
        const int8_t *wb = wg + (int64_t)b * Q8_BLOCK * Q8_ROWS + 2 * r;
        for (int j = 0; j < Q8_BLOCK / 2; j++) {
          o[b * Q8_BLOCK + 2 * j] = (float)wb[j * 2 * Q8_ROWS] * s;
          o[b * Q8_BLOCK + 2 * j + 1] = (float)wb[j * 2 * Q8_ROWS + 1] * s;
        }
      }
    }
  }
}

/* x [M, Kx] (Kx = 2K for PREP_GLU), w [N, K] of `kind`: W_F32, W_BF16 (uint16 bit patterns), or W_Q8 (int8, with
   scale [N, K/32] fp32, both in products.h's interleaved order, N a multiple of 16); bias [N] or NULL, res [M, N]
   or NULL, g [K] (PREP_NORM), y [M, N]; scratch [M, K] when prep != PREP_NONE. Contiguous. */
void final_gemv(const float *x, int M, int K, const void *w, int kind, const float *scale, int N, const float *bias,
                const float *res, int prep, const float *g, float eps, float *scratch, float *y) {
  Acts q = acts_alloc(kind, M, K, 0);
#pragma omp parallel
  {
    sync_init(q.sync);
#pragma omp barrier
    prep_team(x, M, K, prep, g, eps, scratch, NULL, NULL, q.sync);  /* its barrier: rows written before read */
    product_team(prep == PREP_NONE ? x : scratch, M, K, w, kind, scale, N, bias, res, y, q, 0);
  }
  acts_free(q);
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

/* s[t] = (q . K[t]) scale for t < n, K [n, D]: eight keys a pass, so eight FMA chains run side by side (one
   key's chain of D/8 FMAs waited on itself: ~4 cycles an FMA). Each key's sum is dot()'s. */
static void scores(const float *q, const float *K, int64_t n, int D, float scale, float *s) {
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const float *k0 = K + t * D;
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i * D + d), a[i]);
    }
    for (int i = 0; i < 8; i++) {
      float v = hsum(a[i]);
      for (int dd = d; dd < D; dd++) v += q[dd] * k0[i * D + dd];
      s[t + i] = v * scale;
    }
  }
  for (; t < n; t++) s[t] = dot(q, K + t * D, D) * scale;
}

/* s[t] <- exp(s[t] - max s) for t < n, 8 at a time (exp256: ~1e-7 relative, as the SiLU's); returns their sum */
static float exp_shifted(float *s, int64_t n) {
  float m = -INFINITY;
  for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum(acc);
  for (; t < n; t++) {
    s[t] = expf(s[t] - m);
    sum += s[t];
  }
  return sum;
}

/* o [D] += sum over t < n of w[t] V[t], V [n, D]: four keys a pass (o read and written once per four) */
static void weighted_sum(const float *w, const float *V, int64_t n, int D, float *o) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const float *v0 = V + t * D;
    const __m256 w0 = _mm256_set1_ps(w[t]), w1 = _mm256_set1_ps(w[t + 1]), w2 = _mm256_set1_ps(w[t + 2]),
                 w3 = _mm256_set1_ps(w[t + 3]);
    int d = 0;
    for (; d + 8 <= D; d += 8) {
      __m256 acc = _mm256_loadu_ps(o + d);
      acc = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0 + d), acc);
      acc = _mm256_fmadd_ps(w1, _mm256_loadu_ps(v0 + D + d), acc);
      acc = _mm256_fmadd_ps(w2, _mm256_loadu_ps(v0 + 2 * D + d), acc);
      acc = _mm256_fmadd_ps(w3, _mm256_loadu_ps(v0 + 3 * D + d), acc);
      _mm256_storeu_ps(o + d, acc);
    }
    for (; d < D; d++)
      o[d] += w[t] * v0[d] + w[t + 1] * v0[D + d] + w[t + 2] * v0[2 * D + d] + w[t + 3] * v0[3 * D + d];
  }
  for (; t < n; t++)
    for (int d = 0; d < D; d++) o[d] += w[t] * V[t * D + d];
}

#ifndef KV_AHEAD
#define KV_AHEAD (256 * 1024) /* bytes of K/V a thread asks for ahead of its attention (a cartridge's are more) */
#endif
/* Prefetch (into L2) the K/V lines this thread's attention tasks of layer l will read (attend_team's static split of
   the B H head tasks), up to KV_AHEAD bytes: asked for before the qkv product, they arrive while it streams, so
   attention does not wait on memory latency after it (its short reads are too short for the hardware's own
   prefetcher to ramp up). */
static void prefetch_kv(int B, int H, int Hkv, int D, const float *kc, const float *vc, int64_t T,
                        const int64_t *lengths, const int64_t *ptab, const int64_t *plens, int layers, int l) {
  const int t = omp_get_thread_num(), nt = omp_get_num_threads(), tasks = B * H, G = H / Hkv;
  const int lo = (int)((int64_t)tasks * t / nt), hi = (int)((int64_t)tasks * (t + 1) / nt);
  int64_t budget = KV_AHEAD, last = -1;
  for (int task = lo; task < hi && budget > 0; task++) {
    const int h = task / B, b = task % B, g = h / G;
    if ((int64_t)b * Hkv + g == last) continue;  /* the heads of one group read the same K/V */
    last = (int64_t)b * Hkv + g;
    const int64_t p = ptab ? plens[b] : 0, n = lengths[b];
    const int64_t *at = p ? ptab + ((int64_t)b * layers + l) * 2 : NULL;
    const char *spans[4] = {(const char *)(kc + last * T * D), (const char *)(vc + last * T * D),
                            at ? (const char *)(intptr_t)at[0] + g * p * D * 4 : NULL,
                            at ? (const char *)(intptr_t)at[1] + g * p * D * 4 : NULL};
    const int64_t bytes[4] = {n * D * 4, n * D * 4, p * D * 4, p * D * 4};
    for (int i = 0; i < 4 && budget > 0; i++)
      for (int64_t off = 0; spans[i] && off < bytes[i] && budget > 0; off += 64, budget -= 64)
        _mm_prefetch(spans[i] + off, _MM_HINT_T1);
  }
}

static void attend_team(const float *qkv, int B, int H, int Hkv, int D, const float *cos, const float *sin,
                        float *kc, float *vc, int64_t T, const int64_t *lengths, const int64_t *ptab,
                        const int64_t *plens, int layers, int l, float scale, float *out, Sync *sync) {
  const int64_t width = (int64_t)(H + 2 * Hkv) * D, G = H / Hkv;
#pragma omp for schedule(static) nowait
  for (int task = 0; task < B * Hkv; task++) {
    const int b = task / Hkv, g = task % Hkv;
    const float *row = qkv + b * width;
    const int64_t at = (((int64_t)b * Hkv + g) * T + lengths[b]) * D;
    rope_head(row + (int64_t)(H + g) * D, cos + (int64_t)b * D, sin + (int64_t)b * D, D, kc + at);
    for (int d = 0; d < D; d++) vc[at + d] = row[(int64_t)(H + Hkv + g) * D + d];
  }
  sync_team(sync);  /* every new K/V is in the cache before any row attends */
  float *q = malloc(sizeof(float) * D), *o = malloc(sizeof(float) * D), *s = NULL;
  int64_t s_len = 0;
#pragma omp for schedule(static) nowait
  for (int task = 0; task < B * H; task++) {
    /* head-major: a thread takes one head for row after row, so a shared cartridge's K/V of that head stays in its L2 */
    const int h = task / B, b = task % B, g = h / G;
    const int64_t p = ptab ? plens[b] : 0, n = lengths[b] + 1;
    if (p + n > s_len) {
      free(s);
      s = malloc(sizeof(float) * (p + n));
      s_len = p + n;
    }
    rope_head(qkv + b * width + (int64_t)h * D, cos + (int64_t)b * D, sin + (int64_t)b * D, D, q);
    const float *K = kc + ((int64_t)b * Hkv + g) * T * D, *V = vc + ((int64_t)b * Hkv + g) * T * D;
    const float *Kp = NULL, *Vp = NULL;
    if (p) {
      const int64_t *at = ptab + ((int64_t)b * layers + l) * 2;
      Kp = (const float *)(intptr_t)at[0] + (int64_t)g * p * D;
      Vp = (const float *)(intptr_t)at[1] + (int64_t)g * p * D;
    }
    if (p) scores(q, Kp, p, D, scale, s);  /* the prefix's keys, then the row's own: one softmax over both */
    scores(q, K, n, D, scale, s + p);
    const float inv = 1.0f / exp_shifted(s, p + n);
    for (int d = 0; d < D; d++) o[d] = 0.0f;
    if (p) weighted_sum(s, Vp, p, D, o);
    weighted_sum(s + p, V, n, D, o);
    for (int d = 0; d < D; d++) out[(int64_t)b * H * D + (int64_t)h * D + d] = o[d] * inv;
  }
  free(q);
  free(o);
  free(s);
  sync_team(sync);  /* every head's output is written before the o product reads it */
}

/* ---- whole decoder layers: every layer of a decode step in one call and one parallel region ----
   x [M, hidden] is the residual stream, updated in place. Per layer, a row of `wtab` holds (as int64 addresses)
   wqkv, wo, wgu, wd (all of `kind`), their int8 block scales or 0, the qkv bias or 0, in_norm, post_norm;
   `ctab` its K and V cache; ptab/plens the rows' cartridge prefixes or NULL (attend_team). work: [M, (H + 2 Hkv) D
   + H D + max(hidden, inter) + 2 inter] floats.
   What the torch forward does with ~10 calls and ~8 parallel regions a layer, with a barrier between phases. */
enum { W_QKV, W_O, W_GU, W_D, S_QKV, S_O, S_GU, S_D, B_QKV, N_IN, N_POST, W_FIELDS };

void final_decode_layers(float *x, int M, int hidden, int inter, int H, int Hkv, int D, int layers, int kind,
                         const int64_t *wtab, const int64_t *ctab, const int64_t *ptab, const int64_t *plens,
                         const float *cos, const float *sin, int64_t T, const int64_t *lengths, float scale, float eps,
                         float *work) {
  const int nqkv = (H + 2 * Hkv) * D, big = hidden > inter ? hidden : inter;
  float *qkv = work, *att = qkv + (int64_t)M * nqkv, *h = att + (int64_t)M * H * D, *gu = h + (int64_t)M * big;
  Acts q = acts_alloc(kind, M, big > H * D ? big : H * D, M <= PRIVATE_ROWS);  /* the largest input converted */
#pragma omp parallel
  {
    sync_init(q.sync);
#pragma omp barrier
    for (int l = 0; l < layers; l++) {
      const int64_t *w = wtab + (int64_t)l * W_FIELDS;
#define F(i) ((const float *)(intptr_t)w[i])
#define W(i) ((const void *)(intptr_t)w[i])
      PHASE(0, {
        prefetch_kv(M, H, Hkv, D, (const float *)(intptr_t)ctab[2 * l], (const float *)(intptr_t)ctab[2 * l + 1], T,
                    lengths, ptab, plens, layers, l);
        if (M <= PRIVATE_ROWS) {  /* each thread norms the few rows itself: no barrier until the product's */
          normed_product(x, M, hidden, F(N_IN), eps, W(W_QKV), kind, F(S_QKV), nqkv, F(B_QKV), qkv, q);
        } else {
          prep_team(x, M, hidden, PREP_NORM, F(N_IN), eps, h, NULL, NULL, q.sync);
          product_team(h, M, hidden, W(W_QKV), kind, F(S_QKV), nqkv, F(B_QKV), NULL, qkv, q, 0);
        }
        sync_team(q.sync);
      });
      PHASE(1, attend_team(qkv, M, H, Hkv, D, cos, sin, (float *)(intptr_t)ctab[2 * l],
                           (float *)(intptr_t)ctab[2 * l + 1], T, lengths, ptab, plens, layers, l, scale, att,
                           q.sync));
      PHASE(2, {
        product_team(att, M, H * D, W(W_O), kind, F(S_O), hidden, NULL, x, x, q, 0);
        sync_team(q.sync);
      });
      PHASE(3, {
        if (M <= PRIVATE_ROWS) {
          normed_product(x, M, hidden, F(N_POST), eps, W(W_GU), kind, F(S_GU), 2 * inter, NULL, gu, q);
        } else {
          prep_team(x, M, hidden, PREP_NORM, F(N_POST), eps, h, NULL, NULL, q.sync);
          product_team(h, M, hidden, W(W_GU), kind, F(S_GU), 2 * inter, NULL, NULL, gu, q, 0);
        }
        sync_team(q.sync);
      });
      /* the SwiGLU, quantized as it is made for an int8 down product */
      PHASE(4, prep_team(gu, M, inter, PREP_GLU, NULL, 0.0f, h, kind == W_Q8 ? q.xq : NULL, q.xsc, q.sync));
      PHASE(5, {
        product_team(h, M, inter, W(W_D), kind, F(S_D), hidden, NULL, x, x, q, 1);
        sync_team(q.sync);
      });
#undef W
#undef F
    }
  }
  acts_free(q);
}
