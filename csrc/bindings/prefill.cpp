// flash_prefill (one-shot and plan/run), its workspace size and path choice.

#include "bindings.h"
#include "flash_prefill.h"

namespace pagedkern_bindings {
namespace {

// A flash_prefill launch with everything but the per-layer pointers and the stream fixed, as
// PagedAttentionLaunch (attention.cpp); run() returns the path it took.
struct FlashPrefillLaunch {
  pagedkern::FlashPrefillParams p;
  pagedkern::FlashPrefillPath path = pagedkern::FlashPrefillPath::kAuto;
  bool strict = false;
  int device = 0;
  int run(std::uintptr_t q, std::uintptr_t out, std::uintptr_t k_cache, std::uintptr_t v_cache,
          std::uintptr_t lse, std::uintptr_t stream) const {
    DeviceGuard guard(device);
    return static_cast<int>(pagedkern::flash_prefill(for_layer(p, q, out, k_cache, v_cache, lse),
                                                     path, strict, as_stream(stream)));
  }
};

FlashPrefillLaunch flash_prefill_launch(
    std::uintptr_t cu_seqlens_q, std::uintptr_t block_tables, std::uintptr_t seq_lens,
    std::uintptr_t workspace, int64_t q_stride, int64_t out_stride, int64_t block_table_stride,
    int64_t block_table_width, int64_t num_blocks, int total_q, int batch, int num_heads,
    int num_kv_heads, int head_dim, int block_size, double scale, double out_scale, int dtype,
    bool fp8_cache, int path, bool strict, bool check_indices, int device, int variant,
    int window, double soft_cap, std::uintptr_t sinks) {
  FlashPrefillLaunch launch;
  pagedkern::FlashPrefillParams& p = launch.p;
  p.variant = variant;
  p.window = window;
  p.soft_cap = static_cast<float>(soft_cap);
  p.sinks = as_ptr<const float>(sinks);
  p.fp8_cache = fp8_cache;
  p.out_scale = static_cast<float>(out_scale);
  p.cu_seqlens_q = as_ptr<const int>(cu_seqlens_q);
  p.block_tables = as_ptr<const int>(block_tables);
  p.seq_lens = as_ptr<const int>(seq_lens);
  p.workspace = as_ptr<int>(workspace);
  p.q_stride = q_stride;
  p.out_stride = out_stride;
  p.block_table_stride = block_table_stride;
  p.block_table_width = block_table_width;
  p.num_blocks = num_blocks;
  p.total_q = total_q;
  p.batch = batch;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.block_size = block_size;
  p.scale = static_cast<float>(scale);
  p.dtype = static_cast<DType>(dtype);
  p.check_indices = check_indices;
  launch.path = static_cast<pagedkern::FlashPrefillPath>(path);
  launch.strict = strict;
  launch.device = device;
  return launch;
}

#define FLASH_PREFILL_PLAN_ARGS                                                                 \
  py::arg("cu_seqlens_q"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("workspace"), \
      py::arg("q_stride"), py::arg("out_stride"), py::arg("block_table_stride"),                \
      py::arg("block_table_width"), py::arg("num_blocks"), py::arg("total_q"), py::arg("batch"), \
      py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),                       \
      py::arg("block_size"), py::arg("scale"), py::arg("out_scale"), py::arg("dtype"),          \
      py::arg("fp8_cache"), py::arg("path"), py::arg("strict"), py::arg("check_indices"),       \
      py::arg("device"), py::arg("variant"), py::arg("window"), py::arg("soft_cap"),          \
      py::arg("sinks")

}  // namespace

void bind_prefill(py::module_& m) {
  py::dict paths;
  paths["auto"] = int(pagedkern::FlashPrefillPath::kAuto);
  paths["sm80"] = int(pagedkern::FlashPrefillPath::kSm80);
  paths["sm90"] = int(pagedkern::FlashPrefillPath::kSm90);
  m.attr("FLASH_PREFILL_PATHS") = paths;

  // Returns the path that ran (FLASH_PREFILL_PATHS: 1 mma.sync, 2 wgmma + TMA; 0 = automatic).
  m.def(
      "flash_prefill",
      [](std::uintptr_t out, std::uintptr_t lse, std::uintptr_t q, std::uintptr_t k_cache,
         std::uintptr_t v_cache, std::uintptr_t cu_seqlens_q, std::uintptr_t block_tables,
         std::uintptr_t seq_lens, std::uintptr_t workspace, int64_t q_stride, int64_t out_stride,
         int64_t block_table_stride, int64_t block_table_width, int64_t num_blocks, int total_q,
         int batch, int num_heads, int num_kv_heads, int head_dim, int block_size, double scale,
         double out_scale, int dtype, bool fp8_cache, int path, bool strict, bool check_indices,
         int device, int variant, int window, double soft_cap, std::uintptr_t sinks,
         std::uintptr_t stream) {
        // (the parameters in the order of the py::args below: FLASH_PREFILL_PLAN_ARGS, then
        // the stream)
        const FlashPrefillLaunch launch = flash_prefill_launch(
            cu_seqlens_q, block_tables, seq_lens, workspace, q_stride, out_stride,
            block_table_stride, block_table_width, num_blocks, total_q, batch, num_heads,
            num_kv_heads, head_dim, block_size, scale, out_scale, dtype, fp8_cache, path, strict,
            check_indices, device, variant, window, soft_cap, sinks);
        return launch.run(q, out, k_cache, v_cache, lse, stream);
      },
      py::kw_only(), py::arg("out"), py::arg("lse"), py::arg("q"), py::arg("k_cache"),
      py::arg("v_cache"), FLASH_PREFILL_PLAN_ARGS, py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());
  py::class_<FlashPrefillLaunch>(m, "FlashPrefillLaunch")
      .def(py::init(&flash_prefill_launch), py::kw_only(), FLASH_PREFILL_PLAN_ARGS)
      .def("run", &FlashPrefillLaunch::run, py::kw_only(), py::arg("q"), py::arg("out"),
           py::arg("k_cache"), py::arg("v_cache"), py::arg("lse"), py::arg("stream"),
           py::call_guard<py::gil_scoped_release>());
  m.def("flash_prefill_workspace_ints", &pagedkern::flash_prefill_workspace_ints, py::kw_only(),
        py::arg("total_q"), py::arg("batch"));
  // The path flash_prefill takes on `device` for this head dim and block size (aligned arrays).
  m.def(
      "flash_prefill_path",
      [](int device, int head_dim, int block_size, bool fp8_cache, int path) {
        pagedkern::FlashPrefillParams p;
        p.fp8_cache = fp8_cache;
        p.head_dim = head_dim;
        p.block_size = block_size;
        p.num_blocks = 1;
        p.num_kv_heads = 1;
        return static_cast<int>(pagedkern::flash_prefill_select_path(
            p, device, static_cast<pagedkern::FlashPrefillPath>(path), false));
      },
      py::kw_only(), py::arg("device"), py::arg("head_dim"), py::arg("block_size"),
      py::arg("fp8_cache"), py::arg("path"));
}

}  // namespace pagedkern_bindings
