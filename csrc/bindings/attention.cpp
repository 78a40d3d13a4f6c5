// paged_attention (one-shot and plan/run) and rope_and_cache (RoPE + the KV-cache write).

#include "bindings.h"
#include "paged_attention.h"
#include "rope_and_cache.h"

namespace pagedkern_bindings {
namespace {

// A paged_attention launch with everything but the per-layer pointers and the stream fixed: the
// one-shot binding builds one per call, plan/run keeps one per batch.
struct PagedAttentionLaunch {
  pagedkern::PagedAttentionParams p;
  int device = 0;
  void run(std::uintptr_t q, std::uintptr_t out, std::uintptr_t k_cache, std::uintptr_t v_cache,
           std::uintptr_t lse, std::uintptr_t stream) const {
    DeviceGuard guard(device);
    pagedkern::paged_attention(for_layer(p, q, out, k_cache, v_cache, lse), as_stream(stream));
  }
};

PagedAttentionLaunch paged_attention_launch(
    std::uintptr_t block_tables, std::uintptr_t seq_lens, std::uintptr_t workspace,
    int64_t q_stride, int64_t out_stride, int64_t block_table_stride, int64_t block_table_width,
    int64_t num_blocks, int batch, int num_heads, int num_kv_heads, int head_dim, int block_size,
    int num_splits, int split_size, double scale, int dtype, bool check_indices, int device,
    int variant, bool kv_fp8, double k_scale, double v_scale, int window, double soft_cap,
    std::uintptr_t sinks) {
  PagedAttentionLaunch launch;
  pagedkern::PagedAttentionParams& p = launch.p;
  p.block_tables = as_ptr<const int>(block_tables);
  p.seq_lens = as_ptr<const int>(seq_lens);
  p.workspace = as_ptr<float>(workspace);
  p.q_stride = q_stride;
  p.out_stride = out_stride;
  p.block_table_stride = block_table_stride;
  p.block_table_width = block_table_width;
  p.num_blocks = num_blocks;
  p.batch = batch;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.block_size = block_size;
  p.num_splits = num_splits;
  p.split_size = split_size;
  p.scale = static_cast<float>(scale);
  p.k_scale = static_cast<float>(k_scale);
  p.v_scale = static_cast<float>(v_scale);
  p.kv_fp8 = kv_fp8;
  p.dtype = static_cast<DType>(dtype);
  p.check_indices = check_indices;
  p.variant = variant;
  p.window = window;
  p.soft_cap = static_cast<float>(soft_cap);
  p.sinks = as_ptr<const float>(sinks);
  launch.device = device;
  return launch;
}

#define PAGED_ATTENTION_PLAN_ARGS                                                              \
  py::arg("block_tables"), py::arg("seq_lens"), py::arg("workspace"), py::arg("q_stride"),     \
      py::arg("out_stride"), py::arg("block_table_stride"), py::arg("block_table_width"),      \
      py::arg("num_blocks"), py::arg("batch"), py::arg("num_heads"), py::arg("num_kv_heads"),  \
      py::arg("head_dim"), py::arg("block_size"), py::arg("num_splits"), py::arg("split_size"), \
      py::arg("scale"), py::arg("dtype"), py::arg("check_indices"), py::arg("device"),         \
      py::arg("variant"), py::arg("kv_fp8"), py::arg("k_scale"), py::arg("v_scale"),         \
      py::arg("window"), py::arg("soft_cap"), py::arg("sinks")

}  // namespace

void bind_attention(py::module_& m) {
  m.def(
      "paged_attention",
      [](std::uintptr_t out, std::uintptr_t lse, std::uintptr_t q, std::uintptr_t k_cache,
         std::uintptr_t v_cache, std::uintptr_t block_tables, std::uintptr_t seq_lens,
         std::uintptr_t workspace, int64_t q_stride, int64_t out_stride,
         int64_t block_table_stride, int64_t block_table_width, int64_t num_blocks, int batch,
         int num_heads, int num_kv_heads, int head_dim, int block_size, int num_splits,
         int split_size, double scale, int dtype, bool check_indices, int device, int variant,
         bool kv_fp8, double k_scale, double v_scale, int window, double soft_cap,
         std::uintptr_t sinks, std::uintptr_t stream) {
        // (the parameters in the order of the py::args below: PAGED_ATTENTION_PLAN_ARGS, then
        // the stream)
        const PagedAttentionLaunch launch = paged_attention_launch(
            block_tables, seq_lens, workspace, q_stride, out_stride, block_table_stride,
            block_table_width, num_blocks, batch, num_heads, num_kv_heads, head_dim, block_size,
            num_splits, split_size, scale, dtype, check_indices, device, variant, kv_fp8,
            k_scale, v_scale, window, soft_cap, sinks);
        launch.run(q, out, k_cache, v_cache, lse, stream);
      },
      py::kw_only(), py::arg("out"), py::arg("lse"), py::arg("q"), py::arg("k_cache"),
      py::arg("v_cache"), PAGED_ATTENTION_PLAN_ARGS, py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());
  // Plan/run (ops/attention_plan.py): every parameter but the per-layer pointers fixed once.
  py::class_<PagedAttentionLaunch>(m, "PagedAttentionLaunch")
      .def(py::init(&paged_attention_launch), py::kw_only(), PAGED_ATTENTION_PLAN_ARGS)
      .def("run", &PagedAttentionLaunch::run, py::kw_only(), py::arg("q"), py::arg("out"),
           py::arg("k_cache"), py::arg("v_cache"), py::arg("lse"), py::arg("stream"),
           py::call_guard<py::gil_scoped_release>());

  m.def(
      "rope_and_cache",
      [](std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t positions,
         std::uintptr_t cos_sin, std::uintptr_t k_cache, std::uintptr_t v_cache,
         std::uintptr_t slot_mapping, int64_t q_stride, int64_t k_stride, int64_t v_stride,
         int64_t tokens, int64_t max_positions, int64_t num_blocks, int num_heads,
         int num_kv_heads, int head_dim, int block_size, int dtype, bool check_indices,
         int device, std::uintptr_t stream, int variant, bool kv_fp8, double k_scale,
         double v_scale, std::uintptr_t q_norm, std::uintptr_t k_norm, double norm_eps) {
        pagedkern::RopeAndCacheParams p;
        p.variant = variant;
        p.q = as_ptr<void>(q);
        p.k = as_ptr<void>(k);
        p.v = as_ptr<const void>(v);
        p.positions = as_ptr<const int>(positions);
        p.cos_sin = as_ptr<const float>(cos_sin);
        p.k_cache = as_ptr<void>(k_cache);
        p.v_cache = as_ptr<void>(v_cache);
        p.slot_mapping = as_ptr<const int>(slot_mapping);
        p.q_stride = q_stride;
        p.k_stride = k_stride;
        p.v_stride = v_stride;
        p.tokens = tokens;
        p.max_positions = max_positions;
        p.num_blocks = num_blocks;
        p.num_heads = num_heads;
        p.num_kv_heads = num_kv_heads;
        p.head_dim = head_dim;
        p.block_size = block_size;
        p.dtype = static_cast<DType>(dtype);
        p.check_indices = check_indices;
        p.kv_fp8 = kv_fp8;
        // fp32 of the double reciprocal: the reference's torch.tensor(1 / scale, float32)
        p.k_scale_inv = static_cast<float>(1.0 / k_scale);
        p.v_scale_inv = static_cast<float>(1.0 / v_scale);
        p.q_norm = as_ptr<const void>(q_norm);
        p.k_norm = as_ptr<const void>(k_norm);
        p.norm_eps = static_cast<float>(norm_eps);
        DeviceGuard guard(device);
        pagedkern::rope_and_cache(p, as_stream(stream));
      },
      py::kw_only(), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("positions"),
      py::arg("cos_sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
      py::arg("q_stride"), py::arg("k_stride"), py::arg("v_stride"), py::arg("tokens"),
      py::arg("max_positions"), py::arg("num_blocks"), py::arg("num_heads"),
      py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"), py::arg("dtype"),
      py::arg("check_indices"), py::arg("device"), py::arg("stream"), py::arg("variant"),
      py::arg("kv_fp8"), py::arg("k_scale"), py::arg("v_scale"), py::arg("q_norm") = 0,
      py::arg("k_norm") = 0, py::arg("norm_eps") = 1e-6,
      py::call_guard<py::gil_scoped_release>());
}

}  // namespace pagedkern_bindings
