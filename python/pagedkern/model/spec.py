"""ModelSpec: what loads a model, and nothing else of the engine's settings. The engine makes one
from its EngineConfig; a tensor-parallel worker receives one from rank 0 and a draft model is
the target's spec with another model: neither needs the engine to load a model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .. import ops
from .llama import LlamaModel
from .loading import load_model
from .tensor_shard import TensorShard
from .tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model: str | None = None  # a GGUF file, an HF folder, "synthetic:<preset>"; None: default
    dtype: torch.dtype | None = None  # None: the model's (loading.default_dtype)
    seed: int = 0  # synthetic weights
    max_positions: int | None = None  # caps the RoPE table (the context)
    longer_context: bool = False  # max_positions may pass the model's (a draft's, its target's)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    backend: str = "auto"  # the op backend the load's own ops run under

    def load(
        self, device: torch.device, shard: TensorShard | None = None
    ) -> tuple[LlamaModel, Tokenizer]:
        """The model (one tensor-parallel rank's with a shard: loading.load_model)."""
        with ops.use_backend(self.backend):
            model, tokenizer = load_model(
                self.model,
                device,
                self.dtype,
                seed=self.seed,
                max_positions=self.max_positions,
                longer_context=self.longer_context,
                quantization=self.quantization,
                kv_cache_dtype=self.kv_cache_dtype,
                shard=shard,
            )
        return model, tokenizer

    def settings(self) -> dict:
        """The fields as a dict (what rank 0 sends its workers)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
