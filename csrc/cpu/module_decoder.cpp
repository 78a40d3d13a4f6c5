// pagedkern._cpu: a MoE layer's MLP (MoeMlp) and the one-call decoder (Decoder), held as Python
// objects.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <vector>

#include "decoder.h"
#include "module.h"
#include "moe_experts.h"
#include "moe_mlp.h"

namespace py = pybind11;

namespace pagedkern_cpu {

void bind_decoder(py::module_& mod) {
  // one layer's MLP: its stacked experts as tiles, its router and shared expert, if any
  py::class_<MoeMlp, std::shared_ptr<MoeMlp>>(mod, "MoeMlp")
      .def(py::init([](const std::vector<LinearTuple>& gate_up,
                       const std::vector<LinearTuple>& down, int hidden_size, int intermediate,
                       int activation, uintptr_t router, uintptr_t router_bias, int top_k,
                       int scoring, bool renormalize, const LinearTuple& shared_gate_up,
                       const LinearTuple& shared_down, uintptr_t shared_gate) {
             if (gate_up.size() != down.size())
               throw std::invalid_argument("MoeMlp: gate_up and down differ in experts");
             auto moe = std::make_shared<MoeMlp>();
             for (size_t e = 0; e < gate_up.size(); ++e) {
               moe->gate_up.push_back(quant_linear(gate_up[e]));
               moe->down.push_back(quant_linear(down[e]));
             }
             moe->hidden = hidden_size;
             moe->intermediate = intermediate;
             moe->activation = activation;
             moe->experts = int(gate_up.size());
             moe->router = ptr<const float>(router);
             moe->router_bias = ptr<const float>(router_bias);
             moe->top_k = top_k;
             moe->scoring = scoring;
             moe->renormalize = renormalize;
             moe->shared_gate_up = quant_linear(shared_gate_up);
             moe->shared_down = quant_linear(shared_down);
             moe->shared_gate = ptr<const float>(shared_gate);
             if (moe->router != nullptr) check_moe_mlp(*moe);
             return moe;
           }),
           py::kw_only(), py::arg("gate_up"), py::arg("down"), py::arg("hidden_size"),
           py::arg("intermediate"), py::arg("activation"), py::arg("router") = 0,
           py::arg("router_bias") = 0, py::arg("top_k") = 0, py::arg("scoring") = 0,
           py::arg("renormalize") = false, py::arg("shared_gate_up") = LinearTuple{},
           py::arg("shared_down") = LinearTuple{}, py::arg("shared_gate") = 0)
      .def(
          "run_routed",
          [](const MoeMlp& self, uintptr_t hidden, int m, int top_k, uintptr_t ids,
             uintptr_t weights, uintptr_t out, int threads, int64_t parallel_min_macs, int path,
             int activation_bits) {
            const MoeExpertsArgs args{ptr<const float>(hidden),   m,
                                      self.hidden,                self.intermediate,
                                      top_k,                      int(self.gate_up.size()),
                                      ptr<const int32_t>(ids),    ptr<const float>(weights),
                                      self.gate_up.data(),        self.down.data(),
                                      self.activation,            ptr<float>(out),
                                      threads,                    parallel_min_macs,
                                      path,                       activation_bits};
            py::gil_scoped_release release;
            moe_experts(args);
          },
          "hidden, m, top_k, ids, weights, out, threads, parallel_min_macs, path, "
          "activation_bits (positional: the routed experts alone, the caller's routing)")
      .def(
          "run",
          [](const MoeMlp& self, uintptr_t h, int m, uintptr_t out, int threads,
             int64_t parallel_min_macs, int path, int activation_bits) {
            const GemvRun run{m, threads, parallel_min_macs, path, activation_bits};
            py::gil_scoped_release release;
            moe_mlp(self, ptr<const float>(h), m, run, ptr<float>(out));
          },
          "h, m, out, threads, parallel_min_macs, path, activation_bits (positional: the "
          "whole MLP, router included)")
      .def(
          "route",
          [](const MoeMlp& self, uintptr_t h, int m, uintptr_t ids, uintptr_t weights,
             int threads, int64_t parallel_min_macs) {
            check_moe_mlp(self);
            const GemvRun run{m, threads, parallel_min_macs, 0, 16};
            py::gil_scoped_release release;
            moe_route(self, ptr<const float>(h), m, run, ptr<int32_t>(ids), ptr<float>(weights));
          },
          "h, m, ids, weights, threads, parallel_min_macs (positional: the router alone)");
  struct Decoder {
    DecoderShape shape;
    std::vector<DecoderLayer> layers;
    std::vector<std::shared_ptr<MoeMlp>> moe;  // (its MoE layers' MLPs, held while it lives)
  };
  py::class_<Decoder>(mod, "Decoder")
      .def(py::init([](const std::vector<py::dict>& layers, int hq, int hkv, int d, int hidden,
                       int intermediate, float eps, float soft_cap, int activation,
                       int cache_dtype,
                       int64_t block_stride, int64_t head_stride, int64_t slot_stride,
                       int64_t num_blocks, int block_size, int64_t parallel_min_macs) {
             auto decoder = std::make_unique<Decoder>();
             decoder->shape = {hq,           hkv,         d,           hidden,
                               intermediate, eps,         soft_cap,    activation,
                               cache_dtype,  block_stride, head_stride, slot_stride,
                               num_blocks,   block_size,  parallel_min_macs};
             // a layer: ops/cpu/decoder.py's dict of weight tuples, addresses (0: none), ints
             for (const py::dict& layer : layers) {
               const auto linear = [&](const char* key) {
                 return quant_linear(layer[key].cast<LinearTuple>());
               };
               const auto floats = [&](const char* key) {
                 return ptr<float>(layer[key].cast<uintptr_t>());
               };
               const auto number = [&](const char* key) { return layer[key].cast<float>(); };
               decoder->layers.push_back(
                   {linear("qkv"), linear("o"), linear("gate_up"), linear("down"),
                    floats("post_norm"), floats("next_norm"), floats("attn_out_norm"),
                    floats("mlp_out_norm"), floats("q_norm"), floats("k_norm"), floats("sinks"),
                    layer["window"].cast<int>(), floats("factors"),
                    layer["num_positions"].cast<int64_t>(), layer["group"].cast<int>(),
                    floats("k_cache"), floats("v_cache"), number("scale"),
                    number("out_scale"), number("k_inv_scale"), number("v_inv_scale")});
               if (layer.contains("moe") && !layer["moe"].is_none()) {
                 decoder->moe.push_back(layer["moe"].cast<std::shared_ptr<MoeMlp>>());
                 decoder->layers.back().moe = decoder->moe.back().get();
               }
             }
             return decoder;
           }),
           py::kw_only(), py::arg("layers"), py::arg("hq"), py::arg("hkv"), py::arg("d"),
           py::arg("hidden"), py::arg("intermediate"), py::arg("eps"), py::arg("soft_cap"),
           py::arg("activation"), py::arg("cache_dtype"), py::arg("block_stride"),
           py::arg("head_stride"), py::arg("slot_stride"), py::arg("num_blocks"),
           py::arg("block_size"), py::arg("parallel_min_macs"))
      .def(
          "run",
          [](const Decoder& self, int m, uintptr_t h, uintptr_t residual, uintptr_t positions,
             uintptr_t cu_seqlens, uintptr_t seq_lens, int num_chunks,
             const std::vector<std::tuple<uintptr_t, uintptr_t, int64_t, int>>& groups,
             int num_seqs, int threads, int path, int activation_bits) {
            DecoderStep step{m,
                             ptr<float>(h),
                             ptr<float>(residual),
                             ptr<const int32_t>(positions),
                             ptr<const int32_t>(cu_seqlens),
                             ptr<const int32_t>(seq_lens),
                             num_chunks,
                             {},
                             num_seqs,
                             threads,
                             path,
                             activation_bits};
            for (const auto& [slots, tables, stride, width] : groups)
              step.groups.push_back(
                  {ptr<const int32_t>(slots), ptr<const int32_t>(tables), stride, width});
            py::gil_scoped_release release;
            decoder(self.shape, self.layers, step);
          },
          "m, h, residual, positions, cu_seqlens, seq_lens, num_chunks, groups [(slots, "
          "block_tables, table_stride, table_width)], num_seqs, threads, path, "
          "activation_bits (positional, indices int32: one call a step)");
}

}  // namespace pagedkern_cpu
