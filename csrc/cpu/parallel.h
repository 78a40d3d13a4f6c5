// A parallel region over OpenMP's threads, which in the loaded module are torch's intra-op
// threads: torch links libgomp.so.1 and is imported first, so this module's libgomp.so.1
// resolves to the same runtime and team (no second pool competing with torch's spinning
// workers). Built without OpenMP (a compiler without it), one thread.
//
// A team held for a whole call (`team`): the caller's thread leads, running the call's code;
// the team's other threads wait, spinning, for the bodies of the parallel() calls the leader
// makes meanwhile, and run their parts of each. One OpenMP fork a call instead of one a
// parallel(): a decode step of the default model makes ~150, where the second thread started
// ~0.7 us after the first and the first then waited ~1.8 us at each region's end for it.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace pagedkern_cpu {
namespace team_detail {

// What the leader hands its team: one body at a time, `job` bumped for each.
struct Team {
  int size = 1;                  // threads, the leader included
  std::atomic<uint64_t> job{0};  // bodies handed out so far
  std::atomic<int> acks{0};      // the other threads done with the current one
  std::atomic<bool> closed{false};
  int parts = 1;
  const void* body = nullptr;
  void (*run)(const void*, int, int) = nullptr;
  bool busy = false;  // the leader inside a body: a parallel() there runs on its thread alone
};

// The team this thread leads, if any
inline Team*& leading() {
  static thread_local Team* team = nullptr;
  return team;
}

// One turn of a spin-wait; past a few thousand, the core is offered to another thread (an
// oversubscribed machine: the thread waited for may not be running)
inline void spin(uint32_t& turns) {
  if (++turns > 4096) {
    std::this_thread::yield();
    return;
  }
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

}  // namespace team_detail

// Bodies handed to a team since the module loaded (tests: a team ran them)
inline std::atomic<uint64_t>& team_jobs() {
  static std::atomic<uint64_t> jobs{0};
  return jobs;
}

// Runs body(part, parts) on up to `threads` threads (parts <= threads, the caller's thread
// being part 0): on the team the caller leads, else in an OpenMP region.
template <typename Body>
void parallel(int threads, const Body& body) {
  team_detail::Team* team = team_detail::leading();
  if (team != nullptr && !team->busy && threads > 1 && team->size > 1) {
    const int parts = std::min(threads, team->size);
    team->parts = parts;
    team->body = &body;
    team->run = [](const void* b, int part, int n) { (*static_cast<const Body*>(b))(part, n); };
    team->acks.store(0, std::memory_order_relaxed);
    team->job.fetch_add(1, std::memory_order_release);  // (publishes the fields above)
    team_jobs().fetch_add(1, std::memory_order_relaxed);
    team->busy = true;
    body(0, parts);
    team->busy = false;
    // every thread acknowledges, part or not: none reads `body` once the next is handed out
    uint32_t turns = 0;
    while (team->acks.load(std::memory_order_acquire) < team->size - 1) team_detail::spin(turns);
    return;
  }
#ifdef _OPENMP
  if (threads > 1 && !omp_in_parallel()) {
#pragma omp parallel
    {
      const int parts = std::min(omp_get_num_threads(), threads), part = omp_get_thread_num();
      if (part < parts) body(part, parts);
    }
    return;
  }
#endif
  body(0, 1);
}

// Runs leader() on the caller's thread with a team of up to `threads` threads for the
// parallel() calls it makes (nested teams and calls from inside a region: no team). An
// exception from leader() reaches the caller once the team has stopped.
template <typename Leader>
void team(int threads, const Leader& leader) {
#ifdef _OPENMP
  if (threads > 1 && !omp_in_parallel() && team_detail::leading() == nullptr) {
    team_detail::Team t;
    std::exception_ptr error;
#pragma omp parallel num_threads(std::min(threads, omp_get_max_threads()))
    {
      if (omp_get_thread_num() == 0) {
        t.size = omp_get_num_threads();
        team_detail::leading() = &t;
        try {
          leader();
        } catch (...) {
          error = std::current_exception();
        }
        team_detail::leading() = nullptr;
        t.closed.store(true, std::memory_order_release);
      } else {
        const int part = omp_get_thread_num();
        uint64_t seen = 0;
        for (;;) {
          uint64_t job;
          uint32_t turns = 0;
          bool closed = false;
          // (closed comes after the leader's last body was acknowledged: nothing is pending)
          while ((job = t.job.load(std::memory_order_acquire)) == seen)
            if ((closed = t.closed.load(std::memory_order_acquire))) break;
            else team_detail::spin(turns);
          if (closed) break;
          seen = job;
          if (part < t.parts) t.run(t.body, part, t.parts);
          t.acks.fetch_add(1, std::memory_order_release);
        }
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#endif
  leader();
}

}  // namespace pagedkern_cpu
