/* Barriers for the middle of a parallel region (cpu_skinny_gemm.c, cpu_decode_layers.c). */
#ifndef LORAPLEX_CPU_SPIN_BARRIER_H
#define LORAPLEX_CPU_SPIN_BARRIER_H
#include <sched.h>
#include <stdatomic.h>

/* A wait in the middle of a parallel region's team (a decode step's region waits ~13 times
 * per layer; a decode projection between its GEMM and its LoRA). libgomp's own barrier
 * sleeps after a short spin (GOMP_SPINCOUNT, loraplex/openmp.py) and a futex wake then
 * cost more than the wait; this one spins SPIN_BARRIER_PAUSES pauses (~0.5 ms), then
 * yields its core while it waits, for a teammate that lost its own. The last thread to
 * arrive resets the count and moves the phase on (release), the others spin until it has
 * (acquire): what a thread wrote before it is visible to the others after. `phase` is the
 * calling thread's own counter, 0 at the start; `b` starts zeroed. */
#define SPIN_BARRIER_PAUSES 20000
static inline void spin_pause(long spins)
{
    if (spins < SPIN_BARRIER_PAUSES) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    } else {
        sched_yield();
    }
}

struct spin_team {
    atomic_int arrived, phase;
};

static inline void spin_team_wait(struct spin_team *b, int team, int *phase)
{
    const int now = (*phase)++;
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == team - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->phase, now + 1, memory_order_release);
        return;
    }
    for (long spins = 0; atomic_load_explicit(&b->phase, memory_order_acquire) == now; ++spins)
        spin_pause(spins);
}

#endif
