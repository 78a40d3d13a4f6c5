// pybind11 module pagedkern._C: raw pointers (as Python ints), shapes, strides, a dtype code, a
// device index and a stream handle in; kernels launched; C++ exceptions out as Python errors
// (std::invalid_argument -> ValueError, std::runtime_error -> RuntimeError). The Python layer
// (python/pagedkern/ops) has already validated everything a user can get wrong.
//
// A named ABI: every argument is keyword-only (py::kw_only + py::arg), so two swapped strides
// are a TypeError instead of corrupted memory, and the enums the Python side mirrors (dtype
// codes, flash-prefill paths) are module attributes that tests compare with the Python tables.
//
// One file per group of operators (bindings.h lists them); this one makes the module.

#include "bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagedkern CUDA kernels (raw-pointer interface; use pagedkern.ops)";
  using namespace pagedkern_bindings;
  bind_device(m);
  bind_elementwise(m);
  bind_attention(m);
  bind_prefill(m);
  bind_sampling(m);
  bind_quant_gemm(m);
  bind_moe(m);
}
