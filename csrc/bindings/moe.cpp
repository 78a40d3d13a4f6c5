// The fused MoE: routing, grouping by expert, the experts' grouped GEMMs.

#include "bindings.h"
#include "moe.h"
#include "moe_quant.h"

namespace pagedkern_bindings {
namespace {

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

void bind_moe(py::module_& m) {
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

}  // namespace pagedkern_bindings
