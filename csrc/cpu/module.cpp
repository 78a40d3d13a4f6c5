// pagedkern._cpu's Python module: its tables (paths, formats), sampling, and the parts of
// module.h, every kernel called with the GIL released where it runs long.

#include <pybind11/pybind11.h>

#include "module.h"
#include "parallel.h"
#include "quant_gemv.h"
#include "sampling.h"

namespace py = pybind11;
using namespace pagedkern_cpu;

PYBIND11_MODULE(_cpu, mod) {
  mod.doc() = "pagedkern's CPU kernels: quantized GEMV with run-time ISA dispatch, layer tail, attention, RoPE + cache write, decoder, sampling";
  py::dict paths;
  for (int path = 0; path < kNumPaths; ++path) paths[path_name(path)] = path;
  mod.attr("PATHS") = paths;
#ifdef _OPENMP
  mod.attr("OPENMP") = true;
#else
  mod.attr("OPENMP") = false;
#endif
  py::dict formats;
  for (int format = 0; format < kNumFormats; ++format) formats[format_name(format)] = format;
  mod.attr("FORMATS") = formats;
  mod.def("path_supported", &path_supported, py::arg("path"));
  mod.def(
      "sample",
      [](uintptr_t out, uintptr_t logits, int64_t logits_stride, int rows, int vocab,
         uintptr_t temperature, uintptr_t top_p, uintptr_t top_k, uintptr_t min_p, uintptr_t seeds,
         uintptr_t offsets, int threads, uintptr_t logprobs, uintptr_t top_ids,
         uintptr_t top_logprobs, int top_n) {
        SampleArgs args{ptr<int32_t>(out),         ptr<const float>(logits),
                        logits_stride,             rows,
                        vocab,                     ptr<const float>(temperature),
                        ptr<const float>(top_p),   ptr<const int32_t>(top_k),
                        ptr<const float>(min_p),   ptr<const int64_t>(seeds),
                        ptr<const int64_t>(offsets), threads};
        args.logprobs = ptr<float>(logprobs);
        args.top_ids = ptr<int32_t>(top_ids);
        args.top_logprobs = ptr<float>(top_logprobs);
        args.top_n = top_n;
        py::gil_scoped_release release;
        sample(args);
      },
      py::kw_only(), py::arg("out"), py::arg("logits"), py::arg("logits_stride"), py::arg("rows"),
      py::arg("vocab"), py::arg("temperature"), py::arg("top_p"), py::arg("top_k"),
      py::arg("min_p"), py::arg("seeds"), py::arg("offsets"), py::arg("threads"),
      py::arg("logprobs") = 0, py::arg("top_ids") = 0, py::arg("top_logprobs") = 0,
      py::arg("top_n") = 0);
  mod.def("philox_uniform", &philox_uniform, py::arg("seed"), py::arg("offset"));
  mod.def("best_path", &best_path);
  mod.def("team_jobs", [] { return team_jobs().load(); });
  bind_gemv(mod);
  bind_layer(mod);
  bind_decoder(mod);
}
