// A probe of WorkerCpus (kernel_common.h) on this machine's scheduler, for the tests: two
// threads of one call start on the same CPU; the second must leave it, unless it is bound there.
#include <sched.h>

#include <thread>

#include "kernel_common.h"

// bound = 0: the second thread may run on any allowed CPU (it only starts on the first's);
// bound = 1: it is bound to that CPU. Writes the CPU each thread was on after settle() to
// cpus[0..1] and whether the second's affinity was restored as it was to *restored (1 / 0).
// Returns 0, or -1 where the process may run on fewer than 2 CPUs or an affinity call failed.
extern "C" __attribute__((visibility("default"))) int jax_attn_cpu_worker_cpus_probe(
    int bound, int* cpus, int* restored) {
#if defined(__linux__)
  using jax_attn_cpu::WorkerCpus;
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0 || CPU_COUNT(&allowed) < 2) return -1;
  int first = 0;
  while (!CPU_ISSET(first, &allowed)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  WorkerCpus spread;
  int status = 0;
  // Each thread starts bound to `first`, so both are there when they settle.
  std::thread([&] {
    if (sched_setaffinity(0, sizeof(one), &one) != 0) status = -1;
    spread.settle();
    cpus[0] = sched_getcpu();
  }).join();
  std::thread([&] {
    if (sched_setaffinity(0, sizeof(one), &one) != 0) status = -1;
    if (!bound && sched_setaffinity(0, sizeof(allowed), &allowed) != 0) status = -1;
    cpu_set_t before, after;
    sched_getaffinity(0, sizeof(before), &before);
    spread.settle();
    cpus[1] = sched_getcpu();
    sched_getaffinity(0, sizeof(after), &after);
    *restored = CPU_EQUAL(&before, &after) ? 1 : 0;
  }).join();
  return status;
#else
  (void)bound, (void)cpus, (void)restored;
  return -1;
#endif
}
