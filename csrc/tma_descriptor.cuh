// Host side of TMA: a rank-3 tensor map (CUtensorMap) encoded by cuTensorMapEncodeTiled, shared
// by the sm_90a kernels (flash_prefill_sm90.cu, moe_gemm_sm90.cu). The encoder comes from the
// driver at run time: the module links the CUDA runtime only, so it still imports on machines
// without a driver. `who` names the caller in the errors.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common.h"

namespace pagedkern {
namespace tma {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiled encode_tiled(const char* who) {
  static const EncodeTiled fn = [who] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    PK_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                   cudaEnableDefault, &status));
    if (status != cudaDriverEntryPointSuccess || ptr == nullptr) {
      throw std::runtime_error(std::string(who) +
                               ": the CUDA driver has no cuTensorMapEncodeTiled");
    }
    return reinterpret_cast<EncodeTiled>(ptr);
  }();
  return fn;
}

// A rank-3 tensor map with 128-byte swizzle; dims and box innermost first, strides in bytes;
// out-of-bounds elements read as zeros.
inline CUtensorMap tensor_map(const char* who, CUtensorMapDataType type, const void* base,
                              const uint64_t (&dims)[3], const uint64_t (&strides)[2],
                              const uint32_t (&box)[3]) {
  CUtensorMap map;
  const cuuint64_t d[3] = {dims[0], dims[1], dims[2]};
  const cuuint64_t st[2] = {strides[0], strides[1]};
  const cuuint32_t b[3] = {box[0], box[1], box[2]};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode_tiled(who)(&map, type, 3, const_cast<void*>(base), d, st, b,
                                       elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                       CU_TENSOR_MAP_SWIZZLE_128B,
                                       CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw std::runtime_error(std::string(who) + ": cuTensorMapEncodeTiled failed with error " +
                             std::to_string(int(r)));
  }
  return map;
}

}  // namespace tma
}  // namespace pagedkern
