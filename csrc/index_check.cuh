// Debug-mode index checks (PAGEDKERN_CHECK_INDICES=1, params.check_indices): a kernel that meets a
// block id, slot or position outside its range traps (the launch fails with an error at the next
// synchronisation) instead of reading or writing another request's pages. Off, the check is one
// uniform branch on a kernel parameter: no recompile, no registers, no stack.
#pragma once

namespace pagedkern {

__device__ __forceinline__ void check_index(bool enabled, long long value, long long limit) {
  if (enabled && (value < 0 || value >= limit)) __trap();
}

}  // namespace pagedkern
