/* A barrier for the middle of a parallel region (cpu_skinny_gemm.c). */
#ifndef LORAPLEX_CPU_SPIN_BARRIER_H
#define LORAPLEX_CPU_SPIN_BARRIER_H
#include <sched.h>
#include <stdatomic.h>

/* One barrier of a parallel region's team, for a wait in the middle of a decode step's
 * region: `arrived` starts at 0 (one counter per barrier, shared by the team), each thread
 * adds itself and spins until all have. libgomp's own barrier sleeps after a short spin
 * (GOMP_SPINCOUNT, loraplex/openmp.py) and a futex wake then cost more than the wait;
 * this one spins SPIN_BARRIER_PAUSES pauses (~0.5 ms), then yields its core while it
 * waits, for a teammate that lost its own. Release on arrival, acquire on leaving: what a
 * thread wrote before it is visible to the others after. */
#define SPIN_BARRIER_PAUSES 20000
static inline void spin_barrier(atomic_int *arrived, int team)
{
    atomic_fetch_add_explicit(arrived, 1, memory_order_acq_rel);
    for (long spins = 0; atomic_load_explicit(arrived, memory_order_acquire) < team; ++spins) {
        if (spins < SPIN_BARRIER_PAUSES) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        } else
            sched_yield();
    }
}

#endif
