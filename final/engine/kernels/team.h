/* The thread team of a decode step (included by products.h): its barrier, and a -DFINAL_PHASES build's counters
   of where the team spends the step. */
#pragma once
#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* -DFINAL_PHASES (FINAL_GEMV_CFLAGS, bench/profile_decode.py --phases): TSC cycles per thread in each phase of
   final_decode_step (PHASE()), and of those the cycles spent waiting in the team's barrier; read and reset by
   final_phase_cycles. Off in the engine's builds (PHASE is then the statement alone). */
#define PHASES 7
#define PHASE_THREADS 64
#ifdef FINAL_PHASES
#include <x86intrin.h>
static uint64_t phase_cycles[PHASE_THREADS][2][PHASES];  /* [thread][in the phase, waiting][phase] */
static __thread int phase_now = -1;  /* -1 outside PHASE (another entry point's barriers are not counted) */
#define PHASE(i, stmt)                                                              \
  do {                                                                              \
    const int t_ = omp_get_thread_num() % PHASE_THREADS;                            \
    const uint64_t c_ = __rdtsc();                                                  \
    phase_now = (i);                                                                \
    stmt;                                                                           \
    phase_cycles[t_][0][i] += __rdtsc() - c_;                                       \
    phase_now = -1;                                                                 \
  } while (0)
#define WAIT_BEGIN const uint64_t w_ = __rdtsc()
#define WAIT_END \
  if (phase_now >= 0) phase_cycles[omp_get_thread_num() % PHASE_THREADS][1][phase_now] += __rdtsc() - w_
#else
#define PHASE(i, stmt) stmt
#define WAIT_BEGIN
#define WAIT_END
#endif

/* The barrier between the phases of a decode step (a few hundred a step). libgomp's own barrier sleeps in the
   kernel after ~100 spins whenever the process holds more OpenMP threads than there are cores - which one torch
   op on any other thread (the caller's, the HTTP server's) makes true for the life of the process, since each
   thread keeps its own team. Each barrier then costs a futex wake-up, and a batch-1 step took 2.2x as long
   (AGENTS.md). This one spins SPIN_PAUSES pauses (~1 ms) so a phase that ends on time costs ~0.2 us, then yields
   the core SPIN_YIELDS times, then sleeps on a futex (woken by the last thread to arrive, or after 1 ms): a team
   whose thread lost its core (two engines in one process, Ray actors sharing cores) does not burn the others'. */
#ifndef SPIN_PAUSES
#define SPIN_PAUSES (1 << 14)
#endif
#ifndef SPIN_YIELDS
#define SPIN_YIELDS 16
#endif
#if SPIN_PAUSES < 0 || SPIN_YIELDS < 0
#error "SPIN_PAUSES and SPIN_YIELDS must be >= 0"
#endif
static _Atomic int team_sleeps;  /* times a waiting thread slept (final_team_check reads it) */

typedef struct {
  _Alignas(64) _Atomic uint64_t left;  /* a thread's unclaimed chunks of the product: first | last + 1 << 32 */
} Share;

typedef struct {
  atomic_int arrived, phase, sleepers;  /* sleepers: threads in (or about to enter) the futex wait */
  int n;  /* threads in the team */
  Share *share;  /* one per thread of the team (sync_alloc), claim() */
} Sync;

/* a team's Sync for up to `threads` threads (omp_get_max_threads() outside the region), NULL if out of memory */
static Sync *sync_alloc(int threads) {
  Sync *s = malloc(sizeof(Sync));
  if (!s) return NULL;
  s->share = aligned_alloc(64, sizeof(Share) * (size_t)(threads > 0 ? threads : 1));
  if (!s->share) {
    free(s);
    return NULL;
  }
  return s;
}

static void sync_free(Sync *s) {
  if (s) free(s->share);
  free(s);
}

static inline void sync_init(Sync *s) {  /* by every thread of the team, once, then one omp barrier */
  atomic_store(&s->share[omp_get_thread_num()].left, 0);
  if (omp_get_thread_num() == 0) {
    atomic_store(&s->arrived, 0);
    atomic_store(&s->phase, 0);
    atomic_store(&s->sleepers, 0);
    s->n = omp_get_num_threads();
  }
}

/* A product's rows in chunks: each thread owns a contiguous run (so it streams front to back), claims its own
   chunks from the front, and once they are done takes chunks from the back of the run with the most left, so a
   thread whose stream ran slower (its core interrupted, its memory farther) hands its tail to the team instead
   of making the team wait in the barrier. Every run is empty when a product ends (owners empty their own), so a
   thief that reads a run its owner has not set for this product yet finds nothing to take. The caller sets its
   run (claim_init), then claims until claim() returns 0. */
static inline void claim_init(Sync *s, int chunks) {
  const int t = omp_get_thread_num(), T = s->n;
  const uint64_t lo = (uint64_t)chunks * t / T, hi = (uint64_t)chunks * (t + 1) / T;
  atomic_store_explicit(&s->share[t].left, lo | hi << 32, memory_order_release);
}

static inline int claim(Sync *s, int *chunk) {
  _Atomic uint64_t *mine = &s->share[omp_get_thread_num()].left;
  uint64_t v = atomic_load_explicit(mine, memory_order_relaxed);
  while ((uint32_t)v < (uint32_t)(v >> 32))  /* own chunks, front first */
    if (atomic_compare_exchange_weak(mine, &v, v + 1)) {
      *chunk = (int)(uint32_t)v;
      return 1;
    }
#ifndef NO_STEAL
  for (;;) {  /* the back of the run with the most left */
    int most = 0;
    _Atomic uint64_t *from = NULL;
    for (int u = 0; u < s->n; u++) {
      const uint64_t w = atomic_load_explicit(&s->share[u].left, memory_order_acquire);
      const int left = (int)((uint32_t)(w >> 32) - (uint32_t)w);
      if ((uint32_t)w < (uint32_t)(w >> 32) && left > most) most = left, from = &s->share[u].left;
    }
    if (!from) return 0;
    uint64_t w = atomic_load_explicit(from, memory_order_acquire);
    const uint32_t lo = (uint32_t)w, hi = (uint32_t)(w >> 32);
    if (lo < hi && atomic_compare_exchange_strong(from, &w, (uint64_t)lo | (uint64_t)(hi - 1) << 32)) {
      *chunk = (int)(hi - 1);
      return 1;
    }
  }
#else
  return 0;
#endif
}

static inline void sync_team(Sync *s) {
  const int phase = atomic_load_explicit(&s->phase, memory_order_relaxed);
  if (atomic_fetch_add_explicit(&s->arrived, 1, memory_order_acq_rel) == s->n - 1) {  /* the last to arrive */
    atomic_store_explicit(&s->arrived, 0, memory_order_relaxed);
    atomic_store(&s->phase, phase + 1);  /* seq_cst: ordered before the read of sleepers (a sleeper's mirror) */
    if (atomic_load(&s->sleepers)) syscall(SYS_futex, (int *)&s->phase, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    return;
  }
  WAIT_BEGIN;
  for (int spins = 0; atomic_load_explicit(&s->phase, memory_order_acquire) == phase; spins++) {
    if (spins < SPIN_PAUSES) {
      _mm_pause();
    } else if (spins < SPIN_PAUSES + SPIN_YIELDS) {
      sched_yield();
    } else {  /* the kernel sleeps only while phase is still `phase`; 1 ms at most, whatever a wake-up does */
      const struct timespec ms = {0, 1000000};
      atomic_fetch_add(&s->sleepers, 1);
      syscall(SYS_futex, (int *)&s->phase, FUTEX_WAIT_PRIVATE, phase, &ms, NULL, 0);
      atomic_fetch_sub(&s->sleepers, 1);
      atomic_fetch_add_explicit(&team_sleeps, 1, memory_order_relaxed);
      spins = SPIN_PAUSES + SPIN_YIELDS;  /* no overflow of the count however long it waits */
    }
  }
  WAIT_END;
}
