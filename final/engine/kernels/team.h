/* The thread team of a decode step (included by products.h): its barrier, and a -DFINAL_PHASES build's counters
   of where the team spends the step. */
#pragma once
#include <immintrin.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

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
   (AGENTS.md). This one spins ~1 ms before yielding the core, so a phase that ends on time costs ~0.2 us, and a
   thread that lost its core to another process does not make the others spin out their time slice. */
typedef struct {
  atomic_int arrived, phase;
  int n;  /* threads in the team */
} Sync;

static inline void sync_init(Sync *s) {  /* by every thread of the team, once, then one omp barrier */
  if (omp_get_thread_num() == 0) {
    atomic_store(&s->arrived, 0);
    atomic_store(&s->phase, 0);
    s->n = omp_get_num_threads();
  }
}

static inline void sync_team(Sync *s) {
  const int phase = atomic_load_explicit(&s->phase, memory_order_relaxed);
  if (atomic_fetch_add_explicit(&s->arrived, 1, memory_order_acq_rel) == s->n - 1) {  /* the last to arrive */
    atomic_store_explicit(&s->arrived, 0, memory_order_relaxed);
    atomic_store_explicit(&s->phase, phase + 1, memory_order_release);
    return;
  }
  WAIT_BEGIN;
  for (int spins = 0; atomic_load_explicit(&s->phase, memory_order_acquire) == phase; spins++) {
    if (spins < (1 << 14)) _mm_pause();
    else sched_yield();
  }
  WAIT_END;
}
