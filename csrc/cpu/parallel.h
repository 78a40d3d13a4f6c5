// A parallel region over OpenMP's threads, which in the loaded module are torch's intra-op
// threads: torch links libgomp.so.1 and is imported first, so this module's libgomp.so.1
// resolves to the same runtime and team (no second pool competing with torch's spinning
// workers). Built without OpenMP (a compiler without it), one thread.

#pragma once

#include <algorithm>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace pagedkern_cpu {

// Runs body(part, parts) on up to `threads` threads (parts <= threads, the caller's thread
// being part 0).
template <typename Body>
void parallel(int threads, const Body& body) {
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

}  // namespace pagedkern_cpu
