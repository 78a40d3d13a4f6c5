// pybind11 module pagedkern._C: raw pointers (as Python ints), shapes, strides, a dtype code, a
// device index and a stream handle in; kernels launched; C++ exceptions out as Python errors
// (std::invalid_argument -> ValueError, std::runtime_error -> RuntimeError). The Python layer
// (python/pagedkern/ops) has already validated everything a user can get wrong.
//
// A named ABI: every argument is keyword-only (py::kw_only + py::arg), so two swapped strides
// are a TypeError instead of corrupted memory, and the enums the Python side mirrors (dtype
// codes, flash-prefill paths) are module attributes that tests compare with the Python tables.
#include <pybind11/pybind11.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "rms_norm.h"
#include "silu_and_mul.h"
#include "paged_attention.h"
#include "rope_and_cache.h"
#include "sampling.h"
#include "rejection_sampling.h"
#include "flash_prefill.h"
#include "quant_gemm.h"
#include "quant_gemm_marlin.h"
#include "moe.h"
#include "moe_quant.h"

namespace py = pybind11;
using pagedkern::DeviceGuard;
using pagedkern::DType;

namespace {

template <typename P>
P* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<P*>(address);
}

cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

// (count, error message): a machine without a GPU or driver reports 0 and why.
std::tuple<int, std::string> device_count() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it so later calls start clean
    return {0, std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err)};
  }
  return {count, ""};
}

// Device that owns a pointer, or -1 for host or unknown memory.
int pointer_device(std::uintptr_t address) {
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, as_ptr<const void>(address));
  if (err != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged ? attr.device
                                                                                 : -1;
}

// (major, minor) compute capability of `device`.
std::tuple<int, int> compute_capability(int device) {
  int major = 0, minor = 0;
  PK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  PK_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return {major, minor};
}

py::dict build_info() {
  py::dict info;
  info["cuda_runtime_version"] = CUDART_VERSION;
#ifdef PAGEDKERN_CUDA_ARCHS
  info["cuda_architectures"] = PAGEDKERN_CUDA_ARCHS;
#endif
  return info;
}


// A paged_attention launch with everything but the per-layer pointers and the stream fixed: the
// one-shot binding builds one per call, plan/run keeps one per batch.
struct PagedAttentionLaunch {
  pagedkern::PagedAttentionParams p;
  int device = 0;
  void run(std::uintptr_t q, std::uintptr_t out, std::uintptr_t k_cache, std::uintptr_t v_cache,
           std::uintptr_t lse, std::uintptr_t stream) const {
    pagedkern::PagedAttentionParams params = p;
    params.q = as_ptr<const void>(q);
    params.out = as_ptr<void>(out);
    params.k_cache = as_ptr<const void>(k_cache);
    params.v_cache = as_ptr<const void>(v_cache);
    params.lse = as_ptr<float>(lse);
    DeviceGuard guard(device);
    pagedkern::paged_attention(params, as_stream(stream));
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

// flash_prefill likewise: run() returns the path it took.
struct FlashPrefillLaunch {
  pagedkern::FlashPrefillParams p;
  pagedkern::FlashPrefillPath path = pagedkern::FlashPrefillPath::kAuto;
  bool strict = false;
  int device = 0;
  int run(std::uintptr_t q, std::uintptr_t out, std::uintptr_t k_cache, std::uintptr_t v_cache,
          std::uintptr_t lse, std::uintptr_t stream) const {
    pagedkern::FlashPrefillParams params = p;
    params.q = as_ptr<const void>(q);
    params.out = as_ptr<void>(out);
    params.k_cache = as_ptr<const void>(k_cache);
    params.v_cache = as_ptr<const void>(v_cache);
    params.lse = as_ptr<float>(lse);
    DeviceGuard guard(device);
    return static_cast<int>(pagedkern::flash_prefill(params, path, strict, as_stream(stream)));
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

// moe_experts and moe_experts_sm90: one keyword signature, one MoeExpertsParams, two launchers.
void def_moe_experts(py::module_& m, const char* name,
                     void (*launch)(const pagedkern::MoeExpertsParams&, cudaStream_t)) {
  m.def(
      name,
      [launch](std::uintptr_t out, std::uintptr_t h, std::uintptr_t y, std::uintptr_t hidden,
         std::uintptr_t w_gate_up, std::uintptr_t w_down, std::uintptr_t gate_up_bias,
         std::uintptr_t down_bias, std::uintptr_t weights, std::uintptr_t sorted_pairs,
         std::uintptr_t tile_expert, int64_t tokens, int64_t hidden_size, int64_t inter_size,
         int64_t hidden_stride, int64_t out_stride, int64_t padded_rows, int experts, int top_k,
         int tile_m, int activation, float swiglu_alpha, float swiglu_limit, int dtype,
         int device, std::uintptr_t stream, std::uintptr_t workspace, int gate_up_splits,
         int down_splits) {
        pagedkern::MoeExpertsParams p;
        p.workspace = as_ptr<float>(workspace);
        p.gate_up_splits = gate_up_splits;
        p.down_splits = down_splits;
        p.out = as_ptr<void>(out);
        p.h = as_ptr<void>(h);
        p.y = as_ptr<void>(y);
        p.hidden = as_ptr<const void>(hidden);
        p.w_gate_up = as_ptr<const void>(w_gate_up);
        p.w_down = as_ptr<const void>(w_down);
        p.gate_up_bias = as_ptr<const void>(gate_up_bias);
        p.down_bias = as_ptr<const void>(down_bias);
        p.weights = as_ptr<const float>(weights);
        p.sorted_pairs = as_ptr<const int32_t>(sorted_pairs);
        p.tile_expert = as_ptr<const int32_t>(tile_expert);
        p.tokens = tokens;
        p.hidden_size = hidden_size;
        p.inter_size = inter_size;
        p.hidden_stride = hidden_stride;
        p.out_stride = out_stride;
        p.padded_rows = padded_rows;
        p.experts = experts;
        p.top_k = top_k;
        p.tile_m = tile_m;
        p.activation = activation;
        p.swiglu_alpha = swiglu_alpha;
        p.swiglu_limit = swiglu_limit;
        p.dtype = static_cast<DType>(dtype);
        DeviceGuard guard(device);
        launch(p, as_stream(stream));
      },
      py::kw_only(), py::arg("out"), py::arg("h"), py::arg("y"), py::arg("hidden"),
      py::arg("w_gate_up"), py::arg("w_down"), py::arg("gate_up_bias"), py::arg("down_bias"),
      py::arg("weights"), py::arg("sorted_pairs"), py::arg("tile_expert"), py::arg("tokens"),
      py::arg("hidden_size"), py::arg("inter_size"), py::arg("hidden_stride"),
      py::arg("out_stride"), py::arg("padded_rows"), py::arg("experts"), py::arg("top_k"),
      py::arg("tile_m"), py::arg("activation"), py::arg("swiglu_alpha"),
      py::arg("swiglu_limit"), py::arg("dtype"), py::arg("device"), py::arg("stream"),
      py::arg("workspace") = 0, py::arg("gate_up_splits") = 1, py::arg("down_splits") = 1,
      py::call_guard<py::gil_scoped_release>());
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagedkern CUDA kernels (raw-pointer interface; use pagedkern.ops)";
  py::dict dtype_codes;
  dtype_codes["float32"] = int(DType::kFloat32);
  dtype_codes["float16"] = int(DType::kFloat16);
  dtype_codes["bfloat16"] = int(DType::kBFloat16);
  dtype_codes["int32"] = int(DType::kInt32);
  dtype_codes["int64"] = int(DType::kInt64);
  m.attr("DTYPE_CODES") = dtype_codes;
  py::dict paths;
  paths["auto"] = int(pagedkern::FlashPrefillPath::kAuto);
  paths["sm80"] = int(pagedkern::FlashPrefillPath::kSm80);
  paths["sm90"] = int(pagedkern::FlashPrefillPath::kSm90);
  m.attr("FLASH_PREFILL_PATHS") = paths;
  py::dict activations;  // silu_and_mul's `activation` (GatedActivation)
  activations["silu"] = int(pagedkern::GatedActivation::kSilu);
  activations["gelu_tanh"] = int(pagedkern::GatedActivation::kGeluTanh);
  m.attr("GATED_ACTIVATIONS") = activations;

  m.def("device_count", &device_count);
  m.def("pointer_device", &pointer_device, py::kw_only(), py::arg("address"));
  m.def("compute_capability", &compute_capability, py::kw_only(), py::arg("device"));
  m.def("build_info", &build_info);

  m.def(
      "rms_norm",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t residual, std::uintptr_t weight,
         int64_t rows, int64_t hidden, int64_t out_stride, int64_t x_stride,
         int64_t residual_stride, double eps, int dtype, int device, std::uintptr_t stream,
         int variant) {
        pagedkern::RmsNormParams p;
        p.variant = variant;
        p.out = as_ptr<void>(out);
        p.x = as_ptr<const void>(x);
        p.residual = as_ptr<void>(residual);
        p.weight = as_ptr<const void>(weight);
        p.rows = rows;
        p.hidden = hidden;
        p.out_stride = out_stride;
        p.x_stride = x_stride;
        p.residual_stride = residual_stride;
        p.eps = static_cast<float>(eps);
        p.dtype = static_cast<DType>(dtype);
        DeviceGuard guard(device);
        pagedkern::rms_norm(p, as_stream(stream));
      },
      py::kw_only(), py::arg("out"), py::arg("x"), py::arg("residual"), py::arg("weight"),
      py::arg("rows"), py::arg("hidden"), py::arg("out_stride"), py::arg("x_stride"),
      py::arg("residual_stride"), py::arg("eps"), py::arg("dtype"), py::arg("device"),
      py::arg("stream"), py::arg("variant"), py::call_guard<py::gil_scoped_release>());

  m.def(
      "silu_and_mul",
      [](std::uintptr_t out, std::uintptr_t x, int64_t rows, int64_t d, int64_t out_stride,
         int64_t x_stride, int dtype, int activation, int device, std::uintptr_t stream) {
        pagedkern::SiluAndMulParams p;
        p.activation = static_cast<pagedkern::GatedActivation>(activation);
        p.out = as_ptr<void>(out);
        p.x = as_ptr<const void>(x);
        p.rows = rows;
        p.d = d;
        p.out_stride = out_stride;
        p.x_stride = x_stride;
        p.dtype = static_cast<DType>(dtype);
        DeviceGuard guard(device);
        pagedkern::silu_and_mul(p, as_stream(stream));
      },
      py::kw_only(), py::arg("out"), py::arg("x"), py::arg("rows"), py::arg("d"),
      py::arg("out_stride"), py::arg("x_stride"), py::arg("dtype"), py::arg("activation"),
      py::arg("device"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());

  m.def(
      "multiprocessor_count",
      [](int device) {
        int count = 0;
        PK_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
        return count;
      },
      py::kw_only(), py::arg("device"));

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

  m.def(
      "sample",
      [](std::uintptr_t out, std::uintptr_t logits, std::uintptr_t temperature,
         std::uintptr_t top_p, std::uintptr_t top_k, std::uintptr_t seeds, std::uintptr_t offsets,
         int64_t rows, int64_t vocab, int64_t logits_stride, int dtype,
         std::uintptr_t token_offsets, std::uintptr_t token_ids, std::uintptr_t token_counts,
         std::uintptr_t token_bias, std::uintptr_t presence_penalty,
         std::uintptr_t frequency_penalty, std::uintptr_t repetition_penalty,
         std::uintptr_t bitmask, std::uintptr_t bitmask_rows, int64_t bitmask_words,
         std::uintptr_t min_p, std::uintptr_t logprobs, std::uintptr_t top_ids,
         std::uintptr_t top_logprobs, int top_n, std::uintptr_t workspace,
         int64_t workspace_stride, int slices, std::uintptr_t split_state,
         int64_t split_state_stride, int device, std::uintptr_t stream, int variant) {
        pagedkern::SampleParams p;
        p.out = as_ptr<int>(out);
        p.logits = as_ptr<const void>(logits);
        p.temperature = as_ptr<const float>(temperature);
        p.top_p = as_ptr<const float>(top_p);
        p.top_k = as_ptr<const int>(top_k);
        p.seeds = as_ptr<const int64_t>(seeds);
        p.offsets = as_ptr<const int64_t>(offsets);
        p.rows = rows;
        p.vocab = vocab;
        p.logits_stride = logits_stride;
        p.dtype = static_cast<DType>(dtype);
        p.token_offsets = as_ptr<const int>(token_offsets);
        p.token_ids = as_ptr<const int>(token_ids);
        p.token_counts = as_ptr<const int>(token_counts);
        p.token_bias = as_ptr<const float>(token_bias);
        p.presence_penalty = as_ptr<const float>(presence_penalty);
        p.frequency_penalty = as_ptr<const float>(frequency_penalty);
        p.repetition_penalty = as_ptr<const float>(repetition_penalty);
        p.bitmask = as_ptr<const int>(bitmask);
        p.bitmask_rows = as_ptr<const int>(bitmask_rows);
        p.bitmask_words = bitmask_words;
        p.min_p = as_ptr<const float>(min_p);
        p.logprobs = as_ptr<float>(logprobs);
        p.top_ids = as_ptr<int>(top_ids);
        p.top_logprobs = as_ptr<float>(top_logprobs);
        p.top_n = top_n;
        p.workspace = as_ptr<float>(workspace);
        p.workspace_stride = workspace_stride;
        p.slices = slices;
        p.split_state = as_ptr<unsigned long long>(split_state);
        p.split_state_stride = split_state_stride;
        p.variant = variant;
        DeviceGuard guard(device);
        pagedkern::sample(p, as_stream(stream));
      },
      py::kw_only(), py::arg("out"), py::arg("logits"), py::arg("temperature"),
      py::arg("top_p"), py::arg("top_k"), py::arg("seeds"), py::arg("offsets"), py::arg("rows"),
      py::arg("vocab"), py::arg("logits_stride"), py::arg("dtype"), py::arg("token_offsets"),
      py::arg("token_ids"), py::arg("token_counts"), py::arg("token_bias"),
      py::arg("presence_penalty"), py::arg("frequency_penalty"), py::arg("repetition_penalty"),
      py::arg("bitmask"), py::arg("bitmask_rows"), py::arg("bitmask_words"), py::arg("min_p"),
      py::arg("logprobs"), py::arg("top_ids"), py::arg("top_logprobs"), py::arg("top_n"),
      py::arg("workspace"), py::arg("workspace_stride"), py::arg("slices"),
      py::arg("split_state"), py::arg("split_state_stride"), py::arg("device"),
      py::arg("stream"), py::arg("variant"), py::call_guard<py::gil_scoped_release>());

  m.def(
      "rejection_sample",
      [](std::uintptr_t out_token_ids, std::uintptr_t out_num_tokens,
         std::uintptr_t target_probs, std::uintptr_t draft_probs,
         std::uintptr_t draft_token_ids, std::uintptr_t cu_draft, std::uintptr_t seeds,
         std::uintptr_t offsets, int64_t batch, int64_t vocab, int64_t num_draft,
         int64_t out_cols, int64_t target_stride, int64_t draft_stride, bool check_indices,
         int device, std::uintptr_t stream) {
        pagedkern::RejectionSampleParams p;
        p.out_token_ids = as_ptr<int>(out_token_ids);
        p.out_num_tokens = as_ptr<int>(out_num_tokens);
        p.target_probs = as_ptr<const float>(target_probs);
        p.draft_probs = as_ptr<const float>(draft_probs);
        p.draft_token_ids = as_ptr<const int>(draft_token_ids);
        p.cu_draft = as_ptr<const int>(cu_draft);
        p.seeds = as_ptr<const int64_t>(seeds);
        p.offsets = as_ptr<const int64_t>(offsets);
        p.batch = batch;
        p.vocab = vocab;
        p.num_draft = num_draft;
        p.out_cols = out_cols;
        p.target_stride = target_stride;
        p.draft_stride = draft_stride;
        p.check_indices = check_indices;
        DeviceGuard guard(device);
        pagedkern::rejection_sample(p, as_stream(stream));
      },
      py::kw_only(), py::arg("out_token_ids"), py::arg("out_num_tokens"),
      py::arg("target_probs"), py::arg("draft_probs"), py::arg("draft_token_ids"),
      py::arg("cu_draft"), py::arg("seeds"), py::arg("offsets"), py::arg("batch"),
      py::arg("vocab"), py::arg("num_draft"), py::arg("out_cols"), py::arg("target_stride"),
      py::arg("draft_stride"), py::arg("check_indices"), py::arg("device"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());

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
  // --- quant_gemm: weight-only int4/int8 GEMM for M <= quant_gemm_max_m ---------
  m.attr("quant_gemm_max_m") = pagedkern::kQuantGemmMaxM;
  m.def(
      "quant_gemm",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t qweight, std::uintptr_t scales,
         std::uintptr_t mins, int64_t m_rows, int64_t n, int64_t k, int64_t x_stride,
         int64_t out_stride, int bits, int group_size, int dtype, int device,
         std::uintptr_t stream) {
        pagedkern::QuantGemmParams p;
        p.out = as_ptr<void>(out);
        p.x = as_ptr<const void>(x);
        p.qweight = as_ptr<const void>(qweight);
        p.scales = as_ptr<const void>(scales);
        p.mins = as_ptr<const void>(mins);
        p.m = m_rows;
        p.n = n;
        p.k = k;
        p.x_stride = x_stride;
        p.out_stride = out_stride;
        p.bits = bits;
        p.group_size = group_size;
        p.dtype = static_cast<DType>(dtype);
        DeviceGuard guard(device);
        pagedkern::quant_gemm(p, as_stream(stream));
      },
      py::kw_only(), py::arg("out"), py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"),
      py::arg("m"), py::arg("n"), py::arg("k"), py::arg("x_stride"), py::arg("out_stride"),
      py::arg("bits"), py::arg("group_size"), py::arg("dtype"), py::arg("device"),
      py::arg("stream"), py::call_guard<py::gil_scoped_release>());
  // --- quant_gemm_marlin: W4A16 on tensor cores over the tile-ordered int4 weight ----
  m.attr("quant_gemm_marlin_tile_n") = pagedkern::kQuantGemmMarlinTileN;
  m.attr("quant_gemm_marlin_tile_k") = pagedkern::kQuantGemmMarlinTileK;
  m.def(
      "quant_gemm_marlin",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t qweight, std::uintptr_t scales,
         std::uintptr_t mins, std::uintptr_t workspace, std::uintptr_t counters, int64_t m_rows,
         int64_t n, int64_t k,
         int64_t x_stride, int64_t out_stride, int group_size, int k_splits, int dtype, int device,
         std::uintptr_t stream) {
        pagedkern::QuantGemmMarlinParams p;
        p.out = as_ptr<void>(out);
        p.x = as_ptr<const void>(x);
        p.qweight = as_ptr<const void>(qweight);
        p.scales = as_ptr<const void>(scales);
        p.mins = as_ptr<const void>(mins);
        p.workspace = as_ptr<float>(workspace);
        p.counters = as_ptr<int>(counters);
        p.m = m_rows;
        p.n = n;
        p.k = k;
        p.x_stride = x_stride;
        p.out_stride = out_stride;
        p.group_size = group_size;
        p.k_splits = k_splits;
        p.dtype = static_cast<DType>(dtype);
        DeviceGuard guard(device);
        pagedkern::quant_gemm_marlin(p, as_stream(stream));
      },
      py::kw_only(), py::arg("out"), py::arg("x"), py::arg("qweight"), py::arg("scales"),
      py::arg("mins"), py::arg("workspace"), py::arg("counters"), py::arg("m"), py::arg("n"),
      py::arg("k"),
      py::arg("x_stride"), py::arg("out_stride"), py::arg("group_size"), py::arg("k_splits"),
      py::arg("dtype"), py::arg("device"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());
  // --- fused_moe: router, grouping by expert, the experts' grouped GEMMs ---------
  m.attr("moe_max_experts") = pagedkern::kMoeMaxExperts;
  m.def("moe_padded_rows", &pagedkern::moe_padded_rows, py::kw_only(), py::arg("pairs"),
        py::arg("experts"), py::arg("tile_m"));
  // The experts on wgmma + TMA (moe_gemm:sm90_wgmma): moe_experts' arguments, splits 1 only.
  def_moe_experts(m, "moe_experts_sm90", &pagedkern::moe_experts_sm90);
  m.def(
      "moe_route",
      [](std::uintptr_t ids, std::uintptr_t weights, std::uintptr_t logits, int64_t tokens,
         int64_t logits_stride, int experts, int top_k, bool renormalize, int scoring, int dtype,
         int device, std::uintptr_t stream) {
        pagedkern::MoeRouteParams p;
        p.ids = as_ptr<int32_t>(ids);
        p.weights = as_ptr<float>(weights);
        p.logits = as_ptr<const void>(logits);
        p.tokens = tokens;
        p.logits_stride = logits_stride;
        p.experts = experts;
        p.top_k = top_k;
        p.renormalize = renormalize;
        p.scoring = static_cast<pagedkern::MoeScoring>(scoring);
        p.dtype = static_cast<DType>(dtype);
        DeviceGuard guard(device);
        pagedkern::moe_route(p, as_stream(stream));
      },
      py::kw_only(), py::arg("ids"), py::arg("weights"), py::arg("logits"), py::arg("tokens"),
      py::arg("logits_stride"), py::arg("experts"), py::arg("top_k"), py::arg("renormalize"),
      py::arg("scoring"), py::arg("dtype"), py::arg("device"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "moe_align",
      [](std::uintptr_t sorted_pairs, std::uintptr_t tile_expert, std::uintptr_t ids,
         int64_t pairs, int experts, int tile_m, int device, std::uintptr_t stream) {
        pagedkern::MoeAlignParams p;
        p.sorted_pairs = as_ptr<int32_t>(sorted_pairs);
        p.tile_expert = as_ptr<int32_t>(tile_expert);
        p.ids = as_ptr<const int32_t>(ids);
        p.pairs = pairs;
        p.experts = experts;
        p.tile_m = tile_m;
        DeviceGuard guard(device);
        pagedkern::moe_align(p, as_stream(stream));
      },
      py::kw_only(), py::arg("sorted_pairs"), py::arg("tile_expert"), py::arg("ids"),
      py::arg("pairs"), py::arg("experts"), py::arg("tile_m"), py::arg("device"),
      py::arg("stream"), py::call_guard<py::gil_scoped_release>());
  def_moe_experts(m, "moe_experts", &pagedkern::moe_experts);
  m.def(
      "moe_experts_quant",
      [](std::uintptr_t out, std::uintptr_t h, std::uintptr_t y, std::uintptr_t hidden,
         std::uintptr_t gate_up_q, std::uintptr_t gate_up_scales, std::uintptr_t down_q,
         std::uintptr_t down_scales, std::uintptr_t weights, std::uintptr_t sorted_pairs,
         std::uintptr_t tile_expert, int64_t tokens, int64_t hidden_size, int64_t inter_size,
         int64_t hidden_stride, int64_t out_stride, int64_t padded_rows, int experts, int top_k,
         int tile_m, int activation, int bits, int group_size, int dtype, int device,
         std::uintptr_t stream, std::uintptr_t workspace, int gate_up_splits, int down_splits) {
        pagedkern::MoeExpertsQuantParams p;
        p.workspace = as_ptr<float>(workspace);
        p.gate_up_splits = gate_up_splits;
        p.down_splits = down_splits;
        p.out = as_ptr<void>(out);
        p.h = as_ptr<void>(h);
        p.y = as_ptr<void>(y);
        p.hidden = as_ptr<const void>(hidden);
        p.gate_up_q = as_ptr<const void>(gate_up_q);
        p.gate_up_scales = as_ptr<const void>(gate_up_scales);
        p.down_q = as_ptr<const void>(down_q);
        p.down_scales = as_ptr<const void>(down_scales);
        p.weights = as_ptr<const float>(weights);
        p.sorted_pairs = as_ptr<const int32_t>(sorted_pairs);
        p.tile_expert = as_ptr<const int32_t>(tile_expert);
        p.tokens = tokens;
        p.hidden_size = hidden_size;
        p.inter_size = inter_size;
        p.hidden_stride = hidden_stride;
        p.out_stride = out_stride;
        p.padded_rows = padded_rows;
        p.experts = experts;
        p.top_k = top_k;
        p.tile_m = tile_m;
        p.activation = activation;
        p.bits = bits;
        p.group_size = group_size;
        p.dtype = static_cast<DType>(dtype);
        DeviceGuard guard(device);
        pagedkern::moe_experts_quant(p, as_stream(stream));
      },
      py::kw_only(), py::arg("out"), py::arg("h"), py::arg("y"), py::arg("hidden"),
      py::arg("gate_up_q"), py::arg("gate_up_scales"), py::arg("down_q"),
      py::arg("down_scales"), py::arg("weights"), py::arg("sorted_pairs"),
      py::arg("tile_expert"), py::arg("tokens"), py::arg("hidden_size"), py::arg("inter_size"),
      py::arg("hidden_stride"), py::arg("out_stride"), py::arg("padded_rows"),
      py::arg("experts"), py::arg("top_k"), py::arg("tile_m"), py::arg("activation"),
      py::arg("bits"), py::arg("group_size"), py::arg("dtype"), py::arg("device"),
      py::arg("stream"), py::arg("workspace") = 0, py::arg("gate_up_splits") = 1,
      py::arg("down_splits") = 1, py::call_guard<py::gil_scoped_release>());
}
