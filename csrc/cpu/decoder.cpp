// decoder.h: the layers in order, each the per-op path's functions on its buffers.

#include "decoder.h"

#include <stdexcept>
#include <vector>

#include "attention.h"
#include "parallel.h"
#include "rope_cache.h"

namespace pagedkern_cpu {
namespace {

// The step's indices as rope_cache and attention read them: int64 positions and slots, and each
// row's sequence and position (attention.h's chunk_rows), made once a step
struct StepIndices {
  std::vector<int64_t> positions;
  std::vector<std::vector<int64_t>> slots;  // one per KV layer group
  std::vector<int32_t> row_seq, row_pos;

  void make(const DecoderStep& t) {
    positions.assign(t.positions, t.positions + t.m);
    slots.resize(t.groups.size());
    for (size_t g = 0; g < t.groups.size(); ++g)
      slots[g].assign(t.groups[g].slots, t.groups[g].slots + t.m);
    row_seq.resize(t.m);
    row_pos.resize(t.m);
    chunk_rows(t.cu_seqlens, t.seq_lens, t.num_chunks, t.m, row_seq.data(), row_pos.data());
  }
};

// One layer: QKV GEMV, RoPE + cache write, attention, the layer tail (qkv, attn: the step's
// buffers)
void run_layer(const DecoderShape& s, const DecoderLayer& layer, const DecoderStep& t,
               const StepIndices& x, float* qkv, float* attn) {
  const int q_size = s.hq * s.d, qkv_size = (s.hq + 2 * s.hkv) * s.d;
  LayerTailArgs tail{layer.o,         layer.gate_up, layer.down,
                     layer.post_norm, layer.next_norm, s.eps,
                     t.m,             s.hidden,      s.intermediate,
                     t.threads,       s.parallel_min_macs, t.path,
                     t.activation_bits};
  tail.activation = s.activation;
  tail.attn_out_norm = layer.attn_out_norm;
  tail.mlp_out_norm = layer.mlp_out_norm;
  tail.moe = layer.moe;
  const DecoderTables& tables = t.groups[layer.group];
  linear(layer.qkv, tail.gemv(), t.h, s.hidden, qkv);  // the tail's GEMV (+ bias)
  float *q = qkv, *k = qkv + q_size, *v = k + s.hkv * s.d;
  RopeCacheArgs rope{q, qkv_size, k, qkv_size, v, qkv_size, t.m, s.hq, s.hkv, s.d,
                     layer.factors, layer.num_positions, x.positions.data(),
                     x.slots[layer.group].data(), layer.k_cache, layer.v_cache, s.block_stride,
                     s.head_stride, s.slot_stride, s.num_blocks, s.block_size, t.threads};
  rope.q_norm = layer.q_norm;
  rope.k_norm = layer.k_norm;
  rope.norm_eps = s.eps;
  rope.cache_dtype = s.cache_dtype;
  rope.k_inv_scale = layer.k_inv_scale;
  rope.v_inv_scale = layer.v_inv_scale;
  rope_cache(rope);
  attention({q, qkv_size, attn, q_size, nullptr, layer.k_cache, layer.v_cache,
             s.cache_dtype, s.block_stride, s.head_stride, s.slot_stride,
             s.num_blocks, s.hq, s.hkv, s.block_size, s.d, tables.block_tables,
             tables.table_stride, t.num_seqs, tables.table_width, x.row_seq.data(),
             x.row_pos.data(), t.m, layer.scale, s.soft_cap, layer.window, layer.sinks,
             layer.out_scale, t.threads, -1});
  layer_tail(tail, attn, q_size, t.residual, t.h);
}

}  // namespace

void decoder(const DecoderShape& s, const std::vector<DecoderLayer>& layers,
             const DecoderStep& t) {
  const int q_size = s.hq * s.d, qkv_size = (s.hq + 2 * s.hkv) * s.d;
  for (const DecoderLayer& layer : layers) {
    if (layer.qkv.n != qkv_size || layer.qkv.k != s.hidden || layer.o.k != q_size)
      throw std::invalid_argument("decoder: a layer's QKV or O weight does not fit the shape");
    if (layer.group < 0 || layer.group >= int(t.groups.size()))
      throw std::invalid_argument("decoder: a layer's KV group has no tables in this step");
    if (layer.moe != nullptr) {
      if (layer.moe->hidden != s.hidden)
        throw std::invalid_argument("decoder: a layer's MoE MLP does not fit the shape");
      check_moe_mlp(*layer.moe);
    }
  }
  if (t.m <= 0) return;
  thread_local StepIndices indices;
  indices.make(t);
  thread_local std::vector<float> qkv_buf, attn_buf;
  qkv_buf.resize(size_t(t.m) * qkv_size);
  attn_buf.resize(size_t(t.m) * q_size);
  float *qkv = qkv_buf.data(), *attn = attn_buf.data();
  // one team for the step's layers: their ~5 parallel ops a layer run on it (parallel.h)
  team(t.threads, [&] {
    for (const DecoderLayer& layer : layers) run_layer(s, layer, t, indices, qkv, attn);
  });
}

}  // namespace pagedkern_cpu
