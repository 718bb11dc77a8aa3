/* Prefill attention over a prefix segment (included by gemv.c after attention.h): the new tokens' queries of one
   prefill against a cartridge's or a cached prefix's K/V, with the log-sum-exp the caller merges the row's own
   causal attention with (final/engine/attention.py attend_kv). What grows with the prefix in a prefill after it.

   Layout: for each KV head g, its M queries (rows x G heads x new tokens, in any order) q [Hkv, M, D]; the segment's
   K and V of head g at k + g * hs, [n, D] (hs: floats between heads, n * D for a cartridge, more for a view into a
   row's slot). Out: o [Hkv, M, D] and lse [Hkv, M].

   Blocked as flash attention, with the queries across the vector lanes: a block of QB queries transposed once to
   [D][QB], so a key's scores for the whole block are D FMAs of a broadcast key element into QB lanes (no horizontal
   sums), and P V the same way into [D][QB] outputs. Keys go in blocks of KB with an online softmax per lane. The
   (head, query block, key range) tasks are shared out over the threads; key ranges merge by log-sum-exp at the
   end. */
#pragma once

#ifdef __AVX512F__
typedef __m512 vec;
#define VW 16
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vfma _mm512_fmadd_ps
#define vmul _mm512_mul_ps
#define vsub _mm512_sub_ps
#define vadd _mm512_add_ps
#define vmax _mm512_max_ps
static inline vec vexp(vec x) { /* exp256's polynomial, 16 lanes */
  x = _mm512_max_ps(_mm512_min_ps(x, vset1(88.3762626647949f)), vset1(-88.3762626647949f));
  vec fx = _mm512_roundscale_ps(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)),
                                 _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, vset1(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, vset1(-2.12194440e-4f), x);
  vec z = vmul(x, x), y = vset1(1.9875691500E-4f);
  y = vfma(y, x, vset1(1.3981999507E-3f));
  y = vfma(y, x, vset1(8.3334519073E-3f));
  y = vfma(y, x, vset1(4.1665795894E-2f));
  y = vfma(y, x, vset1(1.6666665459E-1f));
  y = vfma(y, x, vset1(5.0000001201E-1f));
  y = vadd(vfma(y, z, x), vset1(1.0f));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(0x7f)), 23);
  return vmul(y, _mm512_castsi512_ps(e));
}
#define PV_D 8 /* output dims a P V pass keeps in registers: 8 x 2 vectors */
#else
typedef __m256 vec;
#define VW 8
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vfma _mm256_fmadd_ps
#define vmul _mm256_mul_ps
#define vsub _mm256_sub_ps
#define vadd _mm256_add_ps
#define vmax _mm256_max_ps
#define vexp exp256
#define PV_D 4 /* 16 registers in all: 4 x 2 accumulators, P, and broadcasts */
#endif
#define QB (2 * VW) /* queries a block: two vectors of lanes */
#define KB 128      /* keys a softmax block: its scores are KB x QB floats, in L1 */

/* scores s[j][QB] = (K[j] . q) scale for j < nk, qt [D][QB] the block's queries transposed; four keys a pass */
static void block_scores(const float *qt, const float *K, int nk, int D, float scale, float *s) {
  int j = 0;
  for (; j + 4 <= nk; j += 4) {
    vec a[4][2];
    for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = vzero();
    const float *k0 = K + (int64_t)j * D;
    for (int d = 0; d < D; d++) {
      const vec q0 = vload(qt + d * QB), q1 = vload(qt + d * QB + VW);
      for (int i = 0; i < 4; i++) {
        const vec kd = vset1(k0[i * D + d]);
        a[i][0] = vfma(kd, q0, a[i][0]);
        a[i][1] = vfma(kd, q1, a[i][1]);
      }
    }
    for (int i = 0; i < 4; i++) {
      vstore(s + (j + i) * QB, vmul(a[i][0], vset1(scale)));
      vstore(s + (j + i) * QB + VW, vmul(a[i][1], vset1(scale)));
    }
  }
  for (; j < nk; j++) {
    vec a0 = vzero(), a1 = vzero();
    for (int d = 0; d < D; d++) {
      const vec kd = vset1(K[(int64_t)j * D + d]);
      a0 = vfma(kd, vload(qt + d * QB), a0);
      a1 = vfma(kd, vload(qt + d * QB + VW), a1);
    }
    vstore(s + j * QB, vmul(a0, vset1(scale)));
    vstore(s + j * QB + VW, vmul(a1, vset1(scale)));
  }
}

/* ot [D][QB] += sum over j < nk of V[j] (x) p[j][QB], PV_D output dims at a time held in registers */
static void block_values(const float *p, const float *V, int nk, int D, float *ot) {
  int d0 = 0;
  for (; d0 + PV_D <= D; d0 += PV_D) {
    vec a[PV_D][2];
    for (int i = 0; i < PV_D; i++) a[i][0] = vload(ot + (d0 + i) * QB), a[i][1] = vload(ot + (d0 + i) * QB + VW);
    for (int j = 0; j < nk; j++) {
      const vec p0 = vload(p + j * QB), p1 = vload(p + j * QB + VW);
      const float *v = V + (int64_t)j * D + d0;
      for (int i = 0; i < PV_D; i++) {
        const vec vd = vset1(v[i]);
        a[i][0] = vfma(vd, p0, a[i][0]);
        a[i][1] = vfma(vd, p1, a[i][1]);
      }
    }
    for (int i = 0; i < PV_D; i++) vstore(ot + (d0 + i) * QB, a[i][0]), vstore(ot + (d0 + i) * QB + VW, a[i][1]);
  }
  for (; d0 < D; d0++) {
    vec a0 = vload(ot + d0 * QB), a1 = vload(ot + d0 * QB + VW);
    for (int j = 0; j < nk; j++) {
      const vec vd = vset1(V[(int64_t)j * D + d0]);
      a0 = vfma(vd, vload(p + j * QB), a0);
      a1 = vfma(vd, vload(p + j * QB + VW), a1);
    }
    vstore(ot + d0 * QB, a0), vstore(ot + d0 * QB + VW, a1);
  }
}

/* one task: queries [q0, q0 + nq) of head g (q: [M, D] of that head) over keys [j0, j1) of K/V [n, D]: the
   unnormalized output ot [D][QB], the running max m [QB] and sum l [QB] (work: qt [D][QB] and s [KB][QB]) */
static void block_task(const float *q, int nq, const float *K, const float *V, int j0, int j1, int D, float scale,
                       float *qt, float *s, float *ot, float *m, float *l) {
  for (int d = 0; d < D; d++)
    for (int i = 0; i < QB; i++) qt[d * QB + i] = i < nq ? q[(int64_t)i * D + d] : 0.0f;
  for (int i = 0; i < D * QB; i++) ot[i] = 0.0f;
  vec m0 = vset1(-INFINITY), m1 = vset1(-INFINITY), l0 = vzero(), l1 = vzero();
  for (int jb = j0; jb < j1; jb += KB) {
    const int nk = jb + KB < j1 ? KB : j1 - jb;
    block_scores(qt, K + (int64_t)jb * D, nk, D, scale, s);
    vec b0 = m0, b1 = m1;
    for (int j = 0; j < nk; j++) b0 = vmax(b0, vload(s + j * QB)), b1 = vmax(b1, vload(s + j * QB + VW));
    const vec c0 = vexp(vsub(m0, b0)), c1 = vexp(vsub(m1, b1));  /* rescale what the earlier blocks summed */
    l0 = vmul(l0, c0), l1 = vmul(l1, c1);
    for (int d = 0; d < D; d++) {
      vstore(ot + d * QB, vmul(vload(ot + d * QB), c0));
      vstore(ot + d * QB + VW, vmul(vload(ot + d * QB + VW), c1));
    }
    for (int j = 0; j < nk; j++) {
      const vec e0 = vexp(vsub(vload(s + j * QB), b0)), e1 = vexp(vsub(vload(s + j * QB + VW), b1));
      vstore(s + j * QB, e0), vstore(s + j * QB + VW, e1);
      l0 = vadd(l0, e0), l1 = vadd(l1, e1);
    }
    m0 = b0, m1 = b1;
    block_values(s, V + (int64_t)jb * D, nk, D, ot);
  }
  vstore(m, m0), vstore(m + VW, m1), vstore(l, l0), vstore(l + VW, l1);
}

/* q [Hkv, M, D] against a segment's K/V (head g at k/v + g hs, [n, D]) -> o [Hkv, M, D], lse [Hkv, M].
   Returns 0, FINAL_ESHAPE or FINAL_ENOMEM (nothing ran). */
int final_prefix_attend(FINAL_PREFIX_ATTEND_PARAMS) {
  if (Hkv < 1 || M < 1 || n < 1 || D < 1 || hs < (int64_t)n * D) return FINAL_ESHAPE;
  const int blocks = (M + QB - 1) / QB, threads = omp_get_max_threads();
  /* key ranges: enough tasks for every thread (4 each), none under KB keys */
  int ranges = (4 * threads + Hkv * blocks - 1) / (Hkv * blocks);
  ranges = ranges < 1 ? 1 : ranges > (n + KB - 1) / KB ? (n + KB - 1) / KB : ranges;
  const int64_t tasks = (int64_t)Hkv * blocks * ranges, part = (int64_t)D * QB + 2 * QB;
  float *parts = alloc((size_t)(tasks * part), sizeof(float));
  float *work = alloc_each((size_t)(D + KB) * QB, sizeof(float), threads);
  if (!parts || !work) {
    free(parts);
    free(work);
    return FINAL_ENOMEM;
  }
  const int per = ((n + ranges - 1) / ranges + KB - 1) / KB * KB;  /* keys a range, whole blocks */
#pragma omp parallel
  {
    float *qt = work + (int64_t)(D + KB) * QB * omp_get_thread_num(), *s = qt + (int64_t)D * QB;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; t++) {
      const int g = (int)(t / ((int64_t)blocks * ranges)), b = (int)(t / ranges % blocks), r = (int)(t % ranges);
      const int q0 = b * QB, nq = M - q0 < QB ? M - q0 : QB, j0 = r * per, j1 = j0 + per < n ? j0 + per : n;
      float *out = parts + t * part;
      if (j0 >= j1) {  /* an empty range (whole blocks ran out): the merge skips it */
        for (int i = 0; i < QB; i++) out[(int64_t)D * QB + i] = -INFINITY, out[(int64_t)D * QB + QB + i] = 0.0f;
        continue;
      }
      block_task(q + ((int64_t)g * M + q0) * D, nq, k + g * hs, v + g * hs, j0, j1, D, scale, qt, s, out,
                 out + (int64_t)D * QB, out + (int64_t)D * QB + QB);
    }
#pragma omp for schedule(static)
    for (int64_t gq = 0; gq < (int64_t)Hkv * M; gq++) {  /* each query: its key ranges merged by log-sum-exp */
      const int g = (int)(gq / M), qi = (int)(gq % M), b = qi / QB, lane = qi % QB;
      const float *first = parts + ((int64_t)g * blocks + b) * ranges * part;
      float big = -INFINITY, sum = 0.0f;
      for (int r = 0; r < ranges; r++) {
        const float mr = first[r * part + (int64_t)D * QB + lane];
        big = mr > big ? mr : big;
      }
      float *dst = o + gq * D;
      for (int d = 0; d < D; d++) dst[d] = 0.0f;
      for (int r = 0; r < ranges; r++) {
        const float *pr = first + r * part;
        if (pr[(int64_t)D * QB + lane] == -INFINITY) continue;  /* an empty range: its outputs were never written */
        const float w = expf(pr[(int64_t)D * QB + lane] - big);
        sum += w * pr[(int64_t)D * QB + QB + lane];
        for (int d = 0; d < D; d++) dst[d] += w * pr[d * QB + lane];
      }
      for (int d = 0; d < D; d++) dst[d] /= sum;
      lse[gq] = big + logf(sum);
    }
  }
  free(parts);
  free(work);
  return 0;
}
