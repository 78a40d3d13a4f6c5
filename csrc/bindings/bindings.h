// The pybind11 module pagedkern._C's shared pieces: the pointer and stream casts every binding
// uses, and one `bind_<group>(m)` per file of this folder (module.cpp calls them in order).

#pragma once

#include <pybind11/pybind11.h>

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace pagedkern_bindings {

namespace py = pybind11;
using pagedkern::DeviceGuard;
using pagedkern::DType;

template <typename P>
P* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<P*>(address);
}

inline cudaStream_t as_stream(std::uintptr_t handle) {
  return reinterpret_cast<cudaStream_t>(handle);
}

// An attention launch's params (paged_attention's, flash_prefill's) with one layer's pointers
template <typename Params>
Params for_layer(Params p, std::uintptr_t q, std::uintptr_t out, std::uintptr_t k_cache,
                 std::uintptr_t v_cache, std::uintptr_t lse) {
  p.q = as_ptr<const void>(q);
  p.out = as_ptr<void>(out);
  p.k_cache = as_ptr<const void>(k_cache);
  p.v_cache = as_ptr<const void>(v_cache);
  p.lse = as_ptr<float>(lse);
  return p;
}

void bind_device(py::module_& m);       // device.cpp: devices, build info, dtype codes
void bind_elementwise(py::module_& m);  // elementwise.cpp: rms_norm, silu_and_mul
void bind_attention(py::module_& m);    // attention.cpp: paged_attention, rope_and_cache
void bind_prefill(py::module_& m);      // prefill.cpp: flash_prefill
void bind_sampling(py::module_& m);     // sampling.cpp: sample, rejection_sample
void bind_quant_gemm(py::module_& m);   // quant_gemm.cpp: quant_gemm, quant_gemm_marlin
void bind_moe(py::module_& m);          // moe.cpp: the fused MoE's kernels

}  // namespace pagedkern_bindings
