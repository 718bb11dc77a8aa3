/* Decode attention for gemv.c's whole-layer step (included by it after products.h): RoPE, the K/V cache write and
   attention of one new token per row, as phases of the step's thread team. */
#pragma once

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
#if KV_AHEAD < 0
#error "KV_AHEAD (bytes of K/V prefetched ahead) must be >= 0"
#endif

/* The rows' prefix segments, attended before each row's own tokens (one softmax over all): a cartridge, then the
   prefix cache's nodes (final/engine/prefix_cache.py). Row b's segment s of layer l has plens[b nseg + s] tokens
   (0: none) whose K and V, each [Hkv, n, D] contiguous fp32, are at the addresses ptab[((b nseg + s) layers + l) 2
   + 0/1]. tab NULL: no row has any. */
typedef struct {
  const int64_t *tab, *lens;
  int nseg, layers;
} Segs;

static inline int64_t seg_len(Segs p, int b, int s) { return p.tab ? p.lens[(int64_t)b * p.nseg + s] : 0; }

/* segment s of row b at layer l, kv head g: its K (kv = 0) or V (kv = 1) rows [n, D] */
static inline const float *seg_rows(Segs p, int b, int s, int l, int g, int kv, int D) {
  const int64_t *at = p.tab + (((int64_t)b * p.nseg + s) * p.layers + l) * 2;
  return (const float *)(intptr_t)at[kv] + (int64_t)g * seg_len(p, b, s) * D;
}

/* whether row b's segment lengths are all >= 0 */
static int segs_ok(Segs p, int b) {
  for (int s = 0; p.tab && s < p.nseg; s++)
    if (seg_len(p, b, s) < 0) return 0;
  return 1;
}

static int64_t segs_total(Segs p, int b) {
  int64_t n = 0;
  for (int s = 0; p.tab && s < p.nseg; s++) n += seg_len(p, b, s);
  return n;
}

/* Prefetch (into L2) the K/V lines this thread's attention tasks of layer l will read (attend_team's static split of
   the B H head tasks), up to KV_AHEAD bytes: asked for before the qkv product, they arrive while it streams, so
   attention does not wait on memory latency after it (its short reads are too short for the hardware's own
   prefetcher to ramp up). */
static void prefetch_kv(int B, int H, int Hkv, int D, const float *kc, const float *vc, int64_t T,
                        const int64_t *lengths, Segs p, int l) {
  const int t = omp_get_thread_num(), nt = omp_get_num_threads(), tasks = B * H, G = H / Hkv;
  const int lo = (int)((int64_t)tasks * t / nt), hi = (int)((int64_t)tasks * (t + 1) / nt);
  int64_t budget = KV_AHEAD, last = -1;
  for (int task = lo; task < hi && budget > 0; task++) {
    const int h = task / B, b = task % B, g = h / G;
    if ((int64_t)b * Hkv + g == last) continue;  /* the heads of one group read the same K/V */
    last = (int64_t)b * Hkv + g;
    for (int s = -1; s < (p.tab ? p.nseg : 0) && budget > 0; s++) {  /* s = -1: the row's own tokens */
      const int64_t n = s < 0 ? lengths[b] : seg_len(p, b, s);
      const char *spans[2] = {s < 0 ? (const char *)(kc + last * T * D) : (const char *)seg_rows(p, b, s, l, g, 0, D),
                              s < 0 ? (const char *)(vc + last * T * D) : (const char *)seg_rows(p, b, s, l, g, 1, D)};
      for (int i = 0; i < 2 && n > 0; i++)
        for (int64_t off = 0; off < n * D * 4 && budget > 0; off += 64, budget -= 64)
          _mm_prefetch(spans[i] + off, _MM_HINT_T1);
    }
  }
}

/* floats a thread's attention scratch takes: q, o, and a score for each of the longest row's prefix + tokens */
static int64_t attend_floats(int B, int D, const int64_t *lengths, Segs p) {
  int64_t longest = 0;
  for (int b = 0; b < B; b++) {
    const int64_t n = segs_total(p, b) + lengths[b] + 1;
    longest = n > longest ? n : longest;
  }
  return 2 * D + longest;
}

/* out [D] = softmax attention of q (post-RoPE) over row b's prefix segments at layer l and kv head g, then its own
   n tokens K/V [n, D]: one softmax over all of them. s: scratch for every score, o: D floats. */
static void attend_head(const float *q, Segs p, int b, int l, int g, const float *K, const float *V, int64_t n,
                        int D, float scale, float *s, float *o, float *out) {
  int64_t at = 0;
  for (int i = 0; p.tab && i < p.nseg; i++) {  /* the prefix's keys, then the row's own */
    const int64_t m = seg_len(p, b, i);
    if (m) scores(q, seg_rows(p, b, i, l, g, 0, D), m, D, scale, s + at);
    at += m;
  }
  scores(q, K, n, D, scale, s + at);
  const float inv = 1.0f / exp_shifted(s, at + n);
  for (int d = 0; d < D; d++) o[d] = 0.0f;
  at = 0;
  for (int i = 0; p.tab && i < p.nseg; i++) {
    const int64_t m = seg_len(p, b, i);
    if (m) weighted_sum(s + at, seg_rows(p, b, i, l, g, 1, D), m, D, o);
    at += m;
  }
  weighted_sum(s + at, V, n, D, o);
  for (int d = 0; d < D; d++) out[d] = o[d] * inv;
}

static void attend_team(const float *qkv, int B, int H, int Hkv, int D, const float *cos, const float *sin,
                        float *kc, float *vc, int64_t T, const int64_t *lengths, Segs p, int l, float scale,
                        float *out, float *mine, Sync *sync) {
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
  /* mine: this thread's q, o and scores (attend_floats(): the longest row's prefix + tokens) */
  float *q = mine, *o = q + D, *s = o + D;
#pragma omp for schedule(static) nowait
  for (int task = 0; task < B * H; task++) {
    /* head-major: a thread takes one head for row after row, so a shared prefix's K/V of that head stays in its L2 */
    const int h = task / B, b = task % B, g = h / G;
    rope_head(qkv + b * width + (int64_t)h * D, cos + (int64_t)b * D, sin + (int64_t)b * D, D, q);
    const int64_t own = ((int64_t)b * Hkv + g) * T * D;
    attend_head(q, p, b, l, g, kc + own, vc + own, lengths[b] + 1, D, scale, s, o,
                out + (int64_t)b * H * D + (int64_t)h * D);
  }
  sync_team(sync);  /* every head's output is written before the o product reads it */
}
