// sample (fused logits processing and sampling) and rejection_sample.

#include "bindings.h"
#include "sampling.h"
#include "rejection_sampling.h"

namespace pagedkern_bindings {

void bind_sampling(py::module_& m) {
  m.def(
      "sample",
      [](std::uintptr_t out, std::uintptr_t logits, std::uintptr_t temperature,
         std::uintptr_t top_p, std::uintptr_t top_k, std::uintptr_t seeds, std::uintptr_t offsets,
         int64_t rows, int64_t vocab, int64_t logits_stride, int dtype,
         std::uintptr_t token_offsets, std::uintptr_t token_ids, std::uintptr_t token_counts,
         std::uintptr_t token_bias, std::uintptr_t presence_penalty,
         std::uintptr_t frequency_penalty, std::uintptr_t repetition_penalty,
         std::uintptr_t bitmask, std::uintptr_t bitmask_rows, int64_t bitmask_words,
         int64_t num_masks, int64_t nnz, bool check_indices, std::uintptr_t min_p, std::uintptr_t logprobs, std::uintptr_t top_ids,
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
        p.num_masks = num_masks;
        p.nnz = nnz;
        p.check_indices = check_indices;
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
      py::arg("bitmask"), py::arg("bitmask_rows"), py::arg("bitmask_words"),
      py::arg("num_masks"), py::arg("nnz"), py::arg("check_indices"), py::arg("min_p"),
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

}

}  // namespace pagedkern_bindings
