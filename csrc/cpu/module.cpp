// pagedkern._cpu's Python module: the quantized GEMV (quant_gemv.h) with the GIL released.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <vector>

#include <tuple>

#include "attention.h"
#include "decoder.h"
#include "gated_activation.h"
#include "layer_tail.h"
#include "moe_experts.h"
#include "moe_mlp.h"
#include "quant_gemv.h"
#include "rope_cache.h"
#include "sampling.h"

namespace py = pybind11;
using namespace pagedkern_cpu;

namespace {

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// (format, packed, scales, bias, n, k) as ops/cpu/layer_tail.py passes a weight
using LinearTuple = std::tuple<int, uintptr_t, uintptr_t, uintptr_t, int, int>;

QuantLinear quant_linear(const LinearTuple& w) {
  const auto& [format, packed, scales, bias, n, k] = w;
  return {format, ptr<const uint8_t>(packed), ptr<const float>(scales), ptr<const float>(bias), n,
          k};
}

}  // namespace

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
  mod.def("packed_bytes", &packed_bytes, py::kw_only(), py::arg("format"), py::arg("n"),
          py::arg("k"));
  mod.def(
      "int4_symmetric",
      [](uintptr_t scales, uintptr_t mins, int64_t count) {
        py::gil_scoped_release release;
        return int4_symmetric(ptr<const uint16_t>(scales), ptr<const uint16_t>(mins), count);
      },
      py::kw_only(), py::arg("scales"), py::arg("mins"), py::arg("count"));
  mod.def(
      "pack_int4",
      [](uintptr_t out, uintptr_t qweight, uintptr_t scales, uintptr_t mins, int n, int k,
         int group, int format) {
        pack_int4(ptr<uint8_t>(out), ptr<const uint8_t>(qweight), ptr<const uint16_t>(scales),
                  ptr<const uint16_t>(mins), n, k, group, format);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("scales"), py::arg("mins"),
      py::arg("n"), py::arg("k"), py::arg("group"), py::arg("format"));
  mod.def(
      "pack_int8",
      [](uintptr_t out, uintptr_t qweight, int n, int k) {
        pack_int8(ptr<uint8_t>(out), ptr<const int8_t>(qweight), n, k);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("n"), py::arg("k"));
  mod.def(
      "pack_int8_grouped",
      [](uintptr_t out, uintptr_t qweight, uintptr_t scales, int n, int k, int group) {
        pack_int8_grouped(ptr<uint8_t>(out), ptr<const int8_t>(qweight), ptr<const float>(scales),
                          n, k, group);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("scales"), py::arg("n"),
      py::arg("k"), py::arg("group"));
  mod.def(
      "pack_int6",
      [](uintptr_t out, uintptr_t qweight, uintptr_t scales, int n, int k) {
        pack_int6(ptr<uint8_t>(out), ptr<const int8_t>(qweight), ptr<const float>(scales), n, k);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("scales"), py::arg("n"),
      py::arg("k"));
  mod.def(
      "factor_int6_scales",
      [](uintptr_t scales, int n, int k, uintptr_t d, uintptr_t c) {
        py::gil_scoped_release release;
        return factor_int6_scales(ptr<const float>(scales), n, k, ptr<float>(d), ptr<int8_t>(c));
      },
      py::kw_only(), py::arg("scales"), py::arg("n"), py::arg("k"), py::arg("d"), py::arg("c"));
  mod.def(
      "pack_int6_k",
      [](uintptr_t out, uintptr_t qweight, uintptr_t c, uintptr_t d, int n, int k) {
        pack_int6_k(ptr<uint8_t>(out), ptr<const int8_t>(qweight), ptr<const int8_t>(c),
                    ptr<const float>(d), n, k);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("c"), py::arg("d"),
      py::arg("n"), py::arg("k"));
  mod.def(
      "factor_int4_scales",
      [](uintptr_t scales, uintptr_t mins, int n, int k, uintptr_t d, uintptr_t dm, uintptr_t cs,
         uintptr_t cm) {
        py::gil_scoped_release release;
        return factor_int4_scales(ptr<const float>(scales), ptr<const float>(mins), n, k,
                                  ptr<float>(d), ptr<float>(dm), ptr<uint8_t>(cs),
                                  ptr<uint8_t>(cm));
      },
      py::kw_only(), py::arg("scales"), py::arg("mins"), py::arg("n"), py::arg("k"),
      py::arg("d"), py::arg("dm"), py::arg("cs"), py::arg("cm"));
  mod.def(
      "pack_int4_k",
      [](uintptr_t out, uintptr_t qweight, uintptr_t cs, uintptr_t cm, uintptr_t d, uintptr_t dm,
         int n, int k) {
        pack_int4_k(ptr<uint8_t>(out), ptr<const uint8_t>(qweight), ptr<const uint8_t>(cs),
                    ptr<const uint8_t>(cm), ptr<const float>(d), ptr<const float>(dm), n, k);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("cs"), py::arg("cm"),
      py::arg("d"), py::arg("dm"), py::arg("n"), py::arg("k"));
  mod.def(
      "pack_int5",
      [](uintptr_t out, uintptr_t qweight, uintptr_t scales, uintptr_t mins, int n, int k) {
        pack_int5(ptr<uint8_t>(out), ptr<const uint8_t>(qweight), ptr<const float>(scales),
                  ptr<const float>(mins), n, k);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("scales"), py::arg("mins"),
      py::arg("n"), py::arg("k"));
  mod.def(
      "gemv",
      [](int format, uintptr_t y, int64_t y_stride, uintptr_t x, int64_t x_stride,
         uintptr_t packed, uintptr_t scales, int m, int n, int k, int threads, int path,
         int activation_bits) {
        py::gil_scoped_release release;
        gemv(format, ptr<float>(y), y_stride, ptr<const float>(x), x_stride,
             ptr<const uint8_t>(packed), ptr<const float>(scales), m, n, k, threads, path,
             activation_bits);
      },
      py::kw_only(), py::arg("format"), py::arg("y"), py::arg("y_stride"), py::arg("x"),
      py::arg("x_stride"), py::arg("packed"), py::arg("scales"), py::arg("m"), py::arg("n"),
      py::arg("k"), py::arg("threads"), py::arg("path"), py::arg("activation_bits"));
  // (tests: the plain loop and the AVX2 one give the same bits)
  mod.def(
      "gated_activation",
      [](int activation, uintptr_t g, uintptr_t out, int rows, int intermediate, bool simd) {
        for (int r = 0; r < rows; ++r)
          gated_activation(activation, ptr<const float>(g) + int64_t(r) * 2 * intermediate,
                           ptr<float>(out) + int64_t(r) * intermediate, intermediate, simd);
      },
      py::kw_only(), py::arg("activation"), py::arg("g"), py::arg("out"), py::arg("rows"),
      py::arg("intermediate"), py::arg("simd"));
  mod.def(
      "layer_tail",
      [](const LinearTuple& o, const LinearTuple& gate_up, const LinearTuple& down,
         uintptr_t post_norm, uintptr_t next_norm, float eps, int m, int hidden,
         int intermediate, uintptr_t attn, int64_t attn_stride, uintptr_t residual,
         uintptr_t h_out, int threads, int64_t parallel_min_macs, int path,
         int activation_bits, int activation, uintptr_t attn_out_norm, uintptr_t mlp_out_norm,
         const MoeMlp* moe) {
        LayerTailArgs args{quant_linear(o), quant_linear(gate_up), quant_linear(down),
                           ptr<const float>(post_norm), ptr<const float>(next_norm), eps,
                           m, hidden, intermediate, threads, parallel_min_macs, path,
                           activation_bits};
        args.activation = activation;
        args.attn_out_norm = ptr<const float>(attn_out_norm);
        args.mlp_out_norm = ptr<const float>(mlp_out_norm);
        args.moe = moe;
        py::gil_scoped_release release;
        layer_tail(args, ptr<const float>(attn), attn_stride, ptr<float>(residual),
                   ptr<float>(h_out));
      },
      py::kw_only(), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("post_norm"),
      py::arg("next_norm"), py::arg("eps"), py::arg("m"), py::arg("hidden"),
      py::arg("intermediate"), py::arg("attn"), py::arg("attn_stride"), py::arg("residual"),
      py::arg("h_out"), py::arg("threads"), py::arg("parallel_min_macs"), py::arg("path"),
      py::arg("activation_bits"), py::arg("activation") = int(kSilu),
      py::arg("attn_out_norm") = 0, py::arg("mlp_out_norm") = 0,
      py::arg("moe") = py::none());
  mod.def("attention_path_supported", &attention_path_supported, py::arg("path"));
  mod.def(
      "attention",
      [](uintptr_t q, int64_t q_row_stride, uintptr_t out, int64_t out_row_stride, uintptr_t lse,
         uintptr_t k_cache, uintptr_t v_cache, int cache_dtype, int64_t block_stride,
         int64_t head_stride, int64_t slot_stride, int64_t num_blocks, int hq, int hkv,
         int block_size, int d, uintptr_t block_tables, int64_t table_stride, int num_seqs,
         int table_width, uintptr_t row_seq, uintptr_t row_pos, int rows, float scale,
         float soft_cap, int window, uintptr_t sinks, float out_scale, int threads, int path) {
        const AttentionArgs args{ptr<const float>(q), q_row_stride, ptr<float>(out),
                                 out_row_stride, ptr<float>(lse), ptr<const void>(k_cache),
                                 ptr<const void>(v_cache), cache_dtype, block_stride,
                                 head_stride, slot_stride, num_blocks, hq, hkv, block_size, d,
                                 ptr<const int32_t>(block_tables), table_stride, num_seqs,
                                 table_width, ptr<const int32_t>(row_seq),
                                 ptr<const int32_t>(row_pos), rows, scale, soft_cap, window,
                                 ptr<const float>(sinks), out_scale, threads, path};
        py::gil_scoped_release release;
        attention(args);
      },
      py::kw_only(), py::arg("q"), py::arg("q_row_stride"), py::arg("out"),
      py::arg("out_row_stride"), py::arg("lse"), py::arg("k_cache"), py::arg("v_cache"),
      py::arg("cache_dtype"), py::arg("block_stride"), py::arg("head_stride"),
      py::arg("slot_stride"), py::arg("num_blocks"), py::arg("hq"), py::arg("hkv"),
      py::arg("block_size"), py::arg("d"), py::arg("block_tables"), py::arg("table_stride"),
      py::arg("num_seqs"), py::arg("table_width"), py::arg("row_seq"), py::arg("row_pos"),
      py::arg("rows"), py::arg("scale"), py::arg("soft_cap"), py::arg("window"),
      py::arg("sinks"), py::arg("out_scale"), py::arg("threads"), py::arg("path"));
  mod.def(
      "rope_cache",
      [](uintptr_t q, int64_t q_row_stride, uintptr_t k, int64_t k_row_stride, uintptr_t v,
         int64_t v_row_stride, int rows, int hq, int hkv, int d, uintptr_t factors,
         int64_t num_positions, uintptr_t positions, uintptr_t slots, uintptr_t k_cache,
         uintptr_t v_cache, int64_t block_stride, int64_t head_stride, int64_t slot_stride,
         int64_t num_blocks, int block_size, int threads, uintptr_t q_norm, uintptr_t k_norm,
         float norm_eps, int cache_dtype, float k_inv_scale, float v_inv_scale) {
        RopeCacheArgs args{ptr<float>(q), q_row_stride, ptr<float>(k), k_row_stride,
                                 ptr<const float>(v), v_row_stride, rows, hq, hkv, d,
                                 ptr<const float>(factors), num_positions,
                                 ptr<const int64_t>(positions), ptr<const int64_t>(slots),
                                 ptr<void>(k_cache), ptr<void>(v_cache), block_stride,
                                 head_stride, slot_stride, num_blocks, block_size, threads};
        args.q_norm = ptr<const float>(q_norm);
        args.k_norm = ptr<const float>(k_norm);
        args.norm_eps = norm_eps;
        args.cache_dtype = cache_dtype;
        args.k_inv_scale = k_inv_scale;
        args.v_inv_scale = v_inv_scale;
        py::gil_scoped_release release;
        rope_cache(args);
      },
      py::kw_only(), py::arg("q"), py::arg("q_row_stride"), py::arg("k"), py::arg("k_row_stride"),
      py::arg("v"), py::arg("v_row_stride"), py::arg("rows"), py::arg("hq"), py::arg("hkv"),
      py::arg("d"), py::arg("factors"), py::arg("num_positions"), py::arg("positions"),
      py::arg("slots"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_stride"),
      py::arg("head_stride"), py::arg("slot_stride"), py::arg("num_blocks"),
      py::arg("block_size"), py::arg("threads"), py::arg("q_norm") = 0, py::arg("k_norm") = 0,
      py::arg("norm_eps") = 1e-6f, py::arg("cache_dtype") = 0, py::arg("k_inv_scale") = 1.0f,
      py::arg("v_inv_scale") = 1.0f);
  mod.def("e4m3_from_float", &e4m3_from_float, py::arg("x"));
  mod.def("bf16_from_float", &bf16_from_float, py::arg("x"));
  mod.def("f16_from_float", &f16_from_float, py::arg("x"));
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
             uintptr_t row_seq, uintptr_t row_pos,
             const std::vector<std::tuple<uintptr_t, uintptr_t, int64_t, int>>& groups,
             int num_seqs, int threads, int path, int activation_bits) {
            DecoderStep step{m,
                             ptr<float>(h),
                             ptr<float>(residual),
                             ptr<const int64_t>(positions),
                             ptr<const int32_t>(row_seq),
                             ptr<const int32_t>(row_pos),
                             {},
                             num_seqs,
                             threads,
                             path,
                             activation_bits};
            for (const auto& [slots, tables, stride, width] : groups)
              step.groups.push_back(
                  {ptr<const int64_t>(slots), ptr<const int32_t>(tables), stride, width});
            py::gil_scoped_release release;
            decoder(self.shape, self.layers, step);
          },
          "m, h, residual, positions, row_seq, row_pos, groups [(slots, block_tables, "
          "table_stride, table_width)], num_seqs, threads, path, activation_bits (positional: "
          "one call a step)");
}
