// pagedkern._cpu: the layer's ops (gated activation, layer tail, attention, RoPE + cache write) and
// the cache's element conversions.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "attention.h"
#include "gated_activation.h"
#include "layer_tail.h"
#include "module.h"
#include "moe_mlp.h"
#include "rope_cache.h"

namespace py = pybind11;

namespace pagedkern_cpu {

void bind_layer(py::module_& mod) {
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
      "chunk_rows",
      [](uintptr_t cu_seqlens, uintptr_t seq_lens, int num_chunks, int rows, uintptr_t row_seq,
         uintptr_t row_pos) {
        chunk_rows(ptr<const int32_t>(cu_seqlens), ptr<const int32_t>(seq_lens), num_chunks,
                   rows, ptr<int32_t>(row_seq), ptr<int32_t>(row_pos));
      },
      py::kw_only(), py::arg("cu_seqlens"), py::arg("seq_lens"), py::arg("num_chunks"),
      py::arg("rows"), py::arg("row_seq"), py::arg("row_pos"));
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
}

}  // namespace pagedkern_cpu
