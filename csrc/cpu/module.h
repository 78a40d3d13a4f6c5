// pagedkern._cpu's Python module, in parts: the casts and the weight tuple every part uses, and
// one `bind_<part>(mod)` per module_<part>.cpp (module.cpp makes the module and calls them).

#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <tuple>

#include "layer_tail.h"

namespace pagedkern_cpu {

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// (format, packed, scales, bias, n, k, input_index) as ops/cpu/module_args.py passes a weight
using LinearTuple = std::tuple<int, uintptr_t, uintptr_t, uintptr_t, int, int, uintptr_t>;

inline QuantLinear quant_linear(const LinearTuple& w) {
  const auto& [format, packed, scales, bias, n, k, input_index] = w;
  return {format, ptr<const uint8_t>(packed), ptr<const float>(scales), ptr<const float>(bias), n,
          k, ptr<const int64_t>(input_index)};
}

void bind_gemv(pybind11::module_& mod);     // module_gemv.cpp: weight packing, the GEMV
void bind_layer(pybind11::module_& mod);    // module_layer.cpp: layer tail, attention, RoPE
void bind_decoder(pybind11::module_& mod);  // module_decoder.cpp: MoE MLP, one-call decoder

}  // namespace pagedkern_cpu
