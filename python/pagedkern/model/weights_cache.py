"""On-disk cache of converted models (dequantized GGUF weights are slow to produce): one folder
per source file and quantization mode (kind "gguf", "gguf-int8", "gguf-int4g32", ...), keyed
by the file's SHA-256, holding the fused weights as safetensors (fp32, an F16 / BF16 file's
projections in their dtype, or a quantized model's int8/int4 parts: never an fp32 copy of a
quantized model), the ModelConfig and the tokenizer. Location: $PAGEDKERN_CACHE_DIR, else
$XDG_CACHE_HOME/pagedkern, else ~/.cache/pagedkern. Writing a file's entry deletes that file's
entries of the same kind in older cache formats."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..envs import ENV
from .config import ModelConfig
from .tokenizer import Tokenizer
from .weights import LlamaWeights

# Bump when the cached layout or the conversion changes, so stale entries are never read.
CACHE_FORMAT = 9  # 2: int8/int4 parts with .qmeta; 3: GGUF Q8_0 / Q6_K exact; 4: Q5_* exact;
# 5: fused parts of two forms as int8 per 32; 6: MoE experts of two forms kept; 7: Q4_K exact;
# 8: F16 / BF16 projections kept 16-bit; 9: Q3_K / IQ4_XS / IQ4_NL exact
_WEIGHTS, _CONFIG, _DONE = "weights.safetensors", "pagedkern_config.json", "complete"


def cache_root() -> Path:
    override = ENV["PAGEDKERN_CACHE_DIR"].get()
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedkern"


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def entry_dir(kind: str, digest: str) -> Path:
    return cache_root() / f"{kind}-v{CACHE_FORMAT}" / digest


def load_entry(
    kind: str,
    digest: str,
    device: torch.device | str,
    dtype: torch.dtype,
    keep_16_bit: bool = False,
) -> tuple[ModelConfig, LlamaWeights, Tokenizer] | None:
    """The cached model (moved as LlamaWeights.to), or None on a miss (or an unreadable
    entry, which is then dropped)."""
    folder = entry_dir(kind, digest)
    if not (folder / _DONE).is_file():
        return None
    try:
        config = ModelConfig.from_dict(json.loads((folder / _CONFIG).read_text()))
        # Straight to the target device: no host copy of a GPU model.
        load_device = "cpu" if torch.device(device).type == "meta" else str(device)
        state = load_file(str(folder / _WEIGHTS), device=load_device)
        weights = LlamaWeights.from_state_dict(config, state).to(device, dtype, keep_16_bit)
        tokenizer = Tokenizer.from_folder(folder)
    except Exception as exc:  # a damaged entry must never stop a load: rebuild it instead
        warnings.warn(f"pagedkern: dropping unreadable cache entry {folder}: {exc}", stacklevel=2)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return config, weights, tokenizer


def store_entry(
    kind: str, digest: str, config: ModelConfig, weights: LlamaWeights, tokenizer: Tokenizer
) -> None:
    """Write the entry atomically (temp folder, then rename); failures only warn."""
    folder = entry_dir(kind, digest)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=folder.parent))
        try:
            state = {k: v.contiguous() for k, v in weights.state_dict().items()}
            save_file(state, str(tmp / _WEIGHTS))
            (tmp / _CONFIG).write_text(json.dumps(config.to_dict()))
            tokenizer.save(tmp)
            (tmp / _DONE).write_text("")
            os.replace(tmp, folder)  # fails if a concurrent writer won: theirs is as good
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        if not (folder / _DONE).is_file():
            warnings.warn(f"pagedkern: could not cache converted model: {exc}", stacklevel=2)
    if (folder / _DONE).is_file():
        _drop_older_formats(kind, digest)


def _drop_older_formats(kind: str, digest: str) -> None:
    """Deletes this file's entries of `kind` in older cache formats (this version never reads
    them, and a model's entry is as big as its weights), and their folders once empty."""
    for version in range(1, CACHE_FORMAT):
        generation = cache_root() / f"{kind}-v{version}"
        shutil.rmtree(generation / digest, ignore_errors=True)
        with contextlib.suppress(OSError):
            generation.rmdir()  # only when empty (other files' entries stay)


# The remembered defaults' own version (cheap to recompute: the tensor table only). 3: a
# mixture of experts' Q4 experts count as layer weights (such files default to int4); 4: Q8_0
# and Q6_K layers keep a quantized default; 5: so do Q5_* ones; 6: and Q3_K / IQ4_* ones
DEFAULTS_FORMAT = 6


def _default_file(digest: str) -> Path:
    return cache_root() / f"defaults-v{DEFAULTS_FORMAT}" / digest


def cached_default(digest: str) -> str | None:
    """The remembered default quantization of a source file, or None."""
    try:
        return _default_file(digest).read_text().strip() or None
    except OSError:
        return None


def store_default(digest: str, quantization: str) -> None:
    path = _default_file(digest)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(quantization)
        os.replace(tmp, path)
    except OSError:
        pass  # only a missed shortcut: the next load parses the header again
