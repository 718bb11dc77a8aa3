/* The embedded engine's decode on CPU: small-M products y = [residual +] [bias +] prep(x) @ W.T with W fp32, bf16
   or int8 (products.h), and the whole decode step built from them (final_decode_step, at the end: the embedding,
   per layer RMSNorm, q|k|v, RoPE, cache write, attention (attention.h), o, SwiGLU, down; the final norm, lm_head).

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
#define _GNU_SOURCE /* nanosleep, syscall (team.h) under -std=c11 */
#include "final_abi.h" /* generated from abi.py by builds.py: the entry points' parameters, the tables' fields */
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

/* count * size bytes, or NULL where that overflows or malloc fails (the caller returns FINAL_ENOMEM) */
static void *alloc(size_t count, size_t size) {
  size_t bytes;
  return __builtin_mul_overflow(count, size, &bytes) ? NULL : malloc(bytes ? bytes : 1);
}

/* count * size bytes per thread for `threads` threads (NULL as alloc) */
static void *alloc_each(size_t count, size_t size, size_t threads) {
  size_t n;
  return __builtin_mul_overflow(count, threads, &n) ? NULL : alloc(n, size);
}

/* priv: the per-thread normed rows (and their int8) normed_product uses. ok: 0 where an allocation failed (then
   free it with acts_free and return FINAL_ENOMEM) */
static Acts acts_alloc(int kind, int M, int K, int priv, int *ok) {
  const size_t T = (size_t)omp_get_max_threads(), n = (size_t)M * (size_t)K;
  Acts a = {NULL, NULL, NULL, NULL, NULL, NULL, (int64_t)n, sync_alloc((int)T)};
  *ok = a.sync != NULL;
  if (priv) *ok &= (a.hp = alloc_each(n, sizeof(float), T)) != NULL;
  if (kind == W_Q8) {
    *ok &= (a.xq = alloc(n, sizeof(int16_t))) != NULL;
    *ok &= (a.xsc = alloc((size_t)M * (K / Q8_BLOCK + 1), sizeof(float))) != NULL;
    if (priv) {
      *ok &= (a.xqp = alloc_each(n, sizeof(int16_t), T)) != NULL;
      *ok &= (a.xscp = alloc_each((size_t)scale_stride(a, M), sizeof(float), T)) != NULL;
    }
  } else if (kind == W_BF16) {
    *ok &= (a.xp = alloc_each(n, sizeof(float), T)) != NULL;
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
  sync_free(a.sync);
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

#ifndef CHUNK_ROWS
#define CHUNK_ROWS 32 /* output rows a claim takes (two int8 groups) */
#endif
#if CHUNK_ROWS < Q8_ROWS || CHUNK_ROWS % Q8_ROWS
#error "CHUNK_ROWS must be a positive multiple of Q8_ROWS (16): an int8 claim covers whole groups of rows"
#endif
/* this thread's rows of y = [res +] [bias +] xs @ w.T, w of `kind` (W_F32, W_BF16, or W_Q8 with its block scales,
   reading xs as xq/xsc), in chunks of CHUNK_ROWS shared out by claim(); xp: the thread's bf16 buffer. No barrier
   after (res may be y: each element is read, then written, by the thread that takes its row). */
static void product_rows(const float *xs, const int16_t *xq, const float *xsc, int M, int K, const void *w,
                         int kind, const float *scale, int N, const float *bias, const float *res, float *y,
                         float *xp, Sync *s) {
  claim_init(s, (N + CHUNK_ROWS - 1) / CHUNK_ROWS);
  uint16_t *hi = NULL, *lo = NULL;
  if (kind == W_BF16) {
#ifdef __AVX512BF16__
    if (M <= BF16_DP_ROWS) {
      hi = (uint16_t *)xp, lo = hi + (int64_t)M * K;  /* 2 M K bf16: the M K floats xp holds */
      bf16_split(xs, M, K, hi, lo);
    }
#endif
    if (!hi) bf16_permute(xs, M, K, xp);
  }
  for (int c; claim(s, &c);) {
    const int n0 = c * CHUNK_ROWS, n1 = n0 + CHUNK_ROWS < N ? n0 + CHUNK_ROWS : N;
    if (kind == W_Q8) rows_q8(xq, xsc, M, K, (const int8_t *)w, scale, n0 / Q8_ROWS, n1 / Q8_ROWS, N, bias, res, y);
#ifdef __AVX512BF16__
    else if (hi) rows_bf16_dp(hi, lo, M, K, (const uint16_t *)w, n0, n1, N, bias, res, y);
#endif
    else rows(kind == W_BF16 ? xp : xs, M, K, w, kind == W_BF16, n0, n1, N, bias, res, y);
  }
}

/* the team's product of xs (the whole team's input, written before a barrier): int8 first quantizes xs into `a`
   with the whole team (a barrier) unless `quantized` (prep_team did). The caller's barrier must come before `a`
   is written again. */
static void product_team(const float *xs, int M, int K, const void *w, int kind, const float *scale, int N,
                         const float *bias, const float *res, float *y, Acts a, int quantized) {
  if (kind == W_Q8 && !quantized) quant16_team(xs, M, K, a.xq, a.xsc, a.sync);
  product_rows(xs, a.xq, a.xsc, M, K, w, kind, scale, N, bias, res, y, thread_xp(a), a.sync);
}

#ifndef PRIVATE_ROWS
#define PRIVATE_ROWS 4
#endif
#if PRIVATE_ROWS < 0
#error "PRIVATE_ROWS (rows each thread norms itself) must be >= 0"
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
  product_rows(h, xq, xsc, M, K, w, kind, scale, N, bias, NULL, y, thread_xp(a), a.sync);
}

int final_gemv_abi(void) { return FINAL_ABI; }

/* the interface this library was built for (abi.py's text(); the loader compares it with its own) */
const char *final_abi_text(void) { return FINAL_ABI_TEXT; }

/* out [PHASE_THREADS][2][PHASES]: the cycles FINAL_PHASES counted since the last call (then zeroed); returns
   PHASES, or 0 in a build without them */
int final_phase_cycles(FINAL_PHASE_CYCLES_PARAMS) {
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
int final_gemv_cpu_ok(FINAL_GEMV_CPU_OK_PARAMS) {
  __builtin_cpu_init();
  int ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#ifdef __AVX512BW__
  ok = ok && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
#ifdef __AVX512BF16__
  ok = ok && __builtin_cpu_supports("avx512bf16");
#endif
#ifdef __AVX512VNNI__
  ok = ok && __builtin_cpu_supports("avx512vnni");
#endif
  return ok;
}

/* x [M, Kx] (Kx = 2K for PREP_GLU), w [N, K] of `kind`: W_F32, W_BF16 (uint16 bit patterns), or W_Q8 (int8, with
   scale [N, K/32] fp32, both in products.h's interleaved order, N a multiple of 16); bias [N] or NULL, res [M, N]
   or NULL, g [K] (PREP_NORM), y [M, N]; scratch [M, K] when prep != PREP_NONE. Contiguous. Returns 0, or
   FINAL_ESHAPE (sizes, kind or prep out of range: nothing ran) or FINAL_ENOMEM. */
int final_gemv(FINAL_GEMV_PARAMS) {
  if (M < 1 || K < 1 || N < 1 || kind < W_F32 || kind > W_BF16 || prep < PREP_NONE || prep > PREP_GLU ||
      (kind == W_Q8 && (K % Q8_BLOCK || N % Q8_ROWS || !scale)) || (prep != PREP_NONE && !scratch) ||
      (prep == PREP_NORM && !g))
    return FINAL_ESHAPE;
  int ok;
  Acts q = acts_alloc(kind, M, K, 0, &ok);
  if (!ok) {
    acts_free(q);
    return FINAL_ENOMEM;
  }
#pragma omp parallel
  {
    sync_init(q.sync);
#pragma omp barrier
    prep_team(x, M, K, prep, g, eps, scratch, NULL, NULL, q.sync);  /* its barrier: rows written before read */
    product_team(prep == PREP_NONE ? x : scratch, M, K, w, kind, scale, N, bias, res, y, q, 0);
  }
  acts_free(q);
  return 0;
}

/* The team's barrier, checked: thread 0 arrives late_us microseconds after the others; returns how many times a
   waiting thread slept in the kernel (team.h sync_team: after its bounded spin), 0 with one thread. */
int final_team_check(FINAL_TEAM_CHECK_PARAMS) {
  Sync *s = sync_alloc(omp_get_max_threads());
  if (!s) return FINAL_ENOMEM;
  const int before = atomic_load(&team_sleeps);
#pragma omp parallel
  {
    sync_init(s);
#pragma omp barrier
    if (omp_get_thread_num() == 0) {
      const struct timespec late = {late_us / 1000000, (long)(late_us % 1000000) * 1000};
      nanosleep(&late, NULL);
    }
    sync_team(s);
  }
  sync_free(s);
  return atomic_load(&team_sleeps) - before;
}

#include "attention.h" /* decode attention: RoPE, the K/V cache write, attention (prefetch_kv, attend_team) */
#include "prefill.h"   /* a prefill's attention over a prefix segment (final_prefix_attend) */

/* ---- the decode step: embedding, every decoder layer and the lm_head in one call and one parallel region ----
   x [M, hidden] is the residual stream, made from the embedding and updated in place. Per layer, a row of `wtab`
   holds (as int64 addresses) wqkv, wo, wgu, wd (all of `kind`), their int8 block scales or 0, their biases or 0,
   in_norm, post_norm (abi.py LAYER_FIELDS, named W_*, S_*, B_*, N_* here); `ctab` its K and V cache; ptab/plens
   the rows' `nseg` prefix segments (cartridges, cached prefixes) or NULL (attention.h Segs).
   `rows` [3, M] int64: each row's token id, position and cached length. work: decode_step_floats() floats.
   What the torch forward does with ~10 calls and ~8 parallel regions a layer, and ~15 torch ops around them (the
   embedding, the rope rows, the final norm, the lm_head's own call): after 150 MB of weights have streamed through
   the caches, each of those ops ran cold at ~20 us. */

/* y = [bias +] RMSNorm(x) @ w.T by the team: each thread norms the rows itself at M <= PRIVATE_ROWS, else the
   team norms them once into h. No barrier after (as product_team). */
static void normed_team(const float *x, int M, int K, const float *g, float eps, const void *w, int kind,
                        const float *scale, int N, const float *bias, float *y, float *h, Acts q) {
  if (M <= PRIVATE_ROWS) {
    normed_product(x, M, K, g, eps, w, kind, scale, N, bias, y, q);
  } else {
    prep_team(x, M, K, PREP_NORM, g, eps, h, NULL, NULL, q.sync);
    product_team(h, M, K, w, kind, scale, N, bias, NULL, y, q, 0);
  }
}

int64_t final_decode_step_floats(FINAL_DECODE_STEP_FLOATS_PARAMS) {
  const int64_t big = hidden > inter ? hidden : inter;
  return (int64_t)M * ((int64_t)(H + 2 * Hkv) * D + (int64_t)H * D + big + 2 * (int64_t)inter + 2 * D);
}

/* the decode step's sizes and rows before anything runs: FINAL_ESHAPE for sizes that are not a model's (H a
   multiple of Hkv, D even, int8's blocks and groups, the work buffer's floats) or 1 + the first row whose id is
   past the embedding's `vocab` rows, whose position is past the tables' `span`, whose cached length leaves no
   slot in the cache's T (the new token is written at it) or whose prefix length is negative; else 0 */
static int step_check(const int64_t *rows, int M, int64_t vocab, int64_t span, int hidden, int inter, int H, int Hkv,
                      int D, int layers, int kind, Segs p, int64_t T, int V, int64_t work_floats) {
  if (M < 1 || hidden < 1 || inter < 1 || H < 1 || Hkv < 1 || H % Hkv || D < 2 || D % 2 || layers < 0 || V < 1 ||
      T < 1 || kind < W_F32 || kind > W_BF16 || (p.tab && (!p.lens || p.nseg < 1)) ||
      work_floats < final_decode_step_floats(M, hidden, inter, H, Hkv, D))
    return FINAL_ESHAPE;
  if (kind == W_Q8 && (hidden % Q8_BLOCK || inter % Q8_BLOCK || (H * D) % Q8_BLOCK || ((H + 2 * Hkv) * D) % Q8_ROWS ||
                       hidden % Q8_ROWS || V % Q8_ROWS))
    return FINAL_ESHAPE;
  for (int b = 0; b < M; b++)
    if (rows[b] < 0 || rows[b] >= vocab || rows[M + b] < 0 || rows[M + b] >= span || rows[2 * M + b] < 0 ||
        rows[2 * M + b] >= T || !segs_ok(p, b))
      return 1 + b;
  return 0;
}

/* x = the embedding rows of the ids, cs = the cos and sin_signed rows at the positions [2, M, D] */
static void step_inputs(const int64_t *rows, int M, const float *embed, int hidden, const float *cos,
                        const float *sin, int D, float *x, float *cs) {
  for (int b = 0; b < M; b++) {
    __builtin_memcpy(x + (int64_t)b * hidden, embed + rows[b] * hidden, sizeof(float) * hidden);
    __builtin_memcpy(cs + (int64_t)b * D, cos + rows[M + b] * D, sizeof(float) * D);
    __builtin_memcpy(cs + (int64_t)(M + b) * D, sin + rows[M + b] * D, sizeof(float) * D);
  }
}

/* head: the lm_head of `kind` [V, hidden] (int64 addresses, abi.py HEAD_FIELDS), logits [M, V]. Returns 0, or
   step_check's code (nothing ran), or FINAL_ENOMEM (nothing ran). */
int final_decode_step(FINAL_DECODE_STEP_PARAMS) {
  const Segs p = {ptab, plens, nseg, layers};
  const int bad = step_check(rows, M, vocab, span, hidden, inter, H, Hkv, D, layers, kind, p, T, V, work_floats);
  if (bad) return bad;
  const int nqkv = (H + 2 * Hkv) * D, big = hidden > inter ? hidden : inter;
  float *qkv = work, *att = qkv + (int64_t)M * nqkv, *h = att + (int64_t)M * H * D, *gu = h + (int64_t)M * big;
  float *cs = gu + (int64_t)M * 2 * inter;
  const int64_t *lengths = rows + 2 * M;
  int ok;
  Acts q = acts_alloc(kind, M, big > H * D ? big : H * D, M <= PRIVATE_ROWS, &ok);  /* the largest input converted */
  const int64_t att_floats = attend_floats(M, D, lengths, p);  /* a thread's attention scratch */
  float *scratch = att_floats > 0 ? alloc_each((size_t)att_floats, sizeof(float), omp_get_max_threads()) : NULL;
  if (!ok || !scratch) {
    acts_free(q);
    free(scratch);
    return FINAL_ENOMEM;
  }
  step_inputs(rows, M, embed, hidden, cos, sin, D, x, cs);
#pragma omp parallel
  {
    sync_init(q.sync);
#pragma omp barrier
    float *mine = scratch + att_floats * omp_get_thread_num();
    for (int l = 0; l < layers; l++) {
      const int64_t *w = wtab + (int64_t)l * W_FIELDS;
      float *kc = (float *)(intptr_t)ctab[2 * l], *vc = (float *)(intptr_t)ctab[2 * l + 1];
#define F(i) ((const float *)(intptr_t)w[i])
#define W(i) ((const void *)(intptr_t)w[i])
      PHASE(0, {
        prefetch_kv(M, H, Hkv, D, kc, vc, T, lengths, p, l);
        normed_team(x, M, hidden, F(N_IN), eps, W(W_QKV), kind, F(S_QKV), nqkv, F(B_QKV), qkv, h, q);
        sync_team(q.sync);
      });
      PHASE(1, attend_team(qkv, M, H, Hkv, D, cs, cs + (int64_t)M * D, kc, vc, T, lengths, p, l, scale, att, mine,
                           q.sync));
      PHASE(2, {  /* x += o + bias: HF's residual + o_proj(att) */
        product_team(att, M, H * D, W(W_O), kind, F(S_O), hidden, F(B_O), x, x, q, 0);
        sync_team(q.sync);
      });
      PHASE(3, {
        normed_team(x, M, hidden, F(N_POST), eps, W(W_GU), kind, F(S_GU), 2 * inter, F(B_GU), gu, h, q);
        sync_team(q.sync);
      });
      /* the SwiGLU, quantized as it is made for an int8 down product */
      PHASE(4, prep_team(gu, M, inter, PREP_GLU, NULL, 0.0f, h, kind == W_Q8 ? q.xq : NULL, q.xsc, q.sync));
      PHASE(5, {
        product_team(h, M, inter, W(W_D), kind, F(S_D), hidden, F(B_D), x, x, q, 1);
        sync_team(q.sync);
      });
#undef W
#undef F
    }
    PHASE(6, normed_team(x, M, hidden, (const float *)(intptr_t)head[H_NORM], eps,
                         (const void *)(intptr_t)head[H_W], kind, (const float *)(intptr_t)head[H_S], V, NULL, logits,
                         h, q));
  }
  acts_free(q);
  free(scratch);
  return 0;
}

/* Decode attention alone, for the torch forward's rows (more than the whole-step call takes, or a model it does
   not: qk-norm): q [M, H, D] post-RoPE; kc/vc one layer's cache [rows, Hkv, T, D] with each row's new K/V already
   written at lengths[b]; ptab/plens/nseg the rows' prefix segments (attention.h Segs, layer l of `layers`) or NULL;
   out [M, H D]. attend_head's arithmetic, so a row's output is the whole-step call's. Returns 0, FINAL_ESHAPE or
   FINAL_ENOMEM (nothing ran). */
int final_attend(FINAL_ATTEND_PARAMS) {
  const Segs p = {ptab, plens, nseg, layers};
  if (M < 1 || H < 1 || Hkv < 1 || H % Hkv || D < 1 || T < 1 || l < 0 || l >= layers || (p.tab && (!p.lens || nseg < 1)))
    return FINAL_ESHAPE;
  for (int b = 0; b < M; b++)
    if (lengths[b] < 0 || lengths[b] >= T || !segs_ok(p, b)) return FINAL_ESHAPE;
  const int64_t floats = attend_floats(M, D, lengths, p), G = H / Hkv;
  float *scratch = alloc_each((size_t)floats, sizeof(float), omp_get_max_threads());
  if (!scratch) return FINAL_ENOMEM;
#pragma omp parallel
  {
    float *o = scratch + floats * omp_get_thread_num(), *s = o + 2 * D;
#pragma omp for schedule(static)
    for (int task = 0; task < M * H; task++) {
      const int h = task / M, b = task % M, g = h / G;
      const int64_t own = ((int64_t)b * Hkv + g) * T * D;
      attend_head(q + ((int64_t)b * H + h) * D, p, b, l, g, kc + own, vc + own, lengths[b] + 1, D, scale, s, o,
                  out + ((int64_t)b * H + h) * D);
    }
  }
  free(scratch);
  return 0;
}
