"""Models from HF model folders: config.json, model.safetensors (or shards listed in
model.safetensors.index.json), tokenizer.json and tokenizer_config.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from . import hf_bitsandbytes, hf_compressed_tensors
from .config import ModelConfig
from .errors import ModelLoadError
from .hf_bitsandbytes import bitsandbytes_getter, bitsandbytes_scheme
from .hf_compressed_tensors import compressed_getter, compressed_tensors_scheme
from .hf_config import config_from_hf, hf_norm_offset
from .hf_quantized import Scheme, quantized_getter, scheme_of
from .mxfp4 import dequantize_mxfp4
from .tensor_shard import Part, TensorShard
from .tokenizer import Tokenizer
from .weight_assembly import assemble_weights
from .weight_shards import cols, rows
from .weights import LlamaWeights

_INDEX = "model.safetensors.index.json"
# AutoGPTQ's and AutoAWQ's own files, where config.json has no quantization_config
_QUANTIZE_CONFIGS = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(path, f"invalid JSON: {exc}") from None


def _raw_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(folder, "no config.json (not a HF model folder)")
    raw = _json(path)
    if not isinstance(raw, dict):
        raise ModelLoadError(path, "config.json must hold a JSON object")
    return raw


def _scheme(folder: Path, raw: dict) -> Scheme | None:
    """How its linears were quantized (scheme_of): config.json's quantization_config, or the
    file an older export keeps beside it."""
    if "quantization_config" in raw:
        qc = raw["quantization_config"]
        if isinstance(qc, dict) and qc.get("quant_method") == hf_compressed_tensors.METHOD:
            return compressed_tensors_scheme(qc, str(folder / "config.json"))
        if isinstance(qc, dict) and qc.get("quant_method") == hf_bitsandbytes.METHOD:
            return bitsandbytes_scheme(qc, str(folder / "config.json"))
        return scheme_of(raw, str(folder / "config.json"))
    for name, method in _QUANTIZE_CONFIGS:
        side = folder / name
        if side.is_file():
            qc = _json(side)
            if isinstance(qc, dict):
                qc = {"quant_method": method, **qc}
            return scheme_of({"quantization_config": qc}, str(side))
    return None


def _read_config(folder: Path) -> tuple[ModelConfig, float, Scheme | None]:
    """(config, norm offset, how its linears were quantized): see hf_norm_offset, _scheme."""
    raw = _raw_config(folder)
    path = str(folder / "config.json")
    return config_from_hf(raw, path), hf_norm_offset(raw), _scheme(folder, raw)


def hf_checkpoint_quantization(folder: str | os.PathLike) -> str | None:
    """The mode a pre-quantized folder's linears load in ('int4' / 'int8'; GPTQ, AWQ,
    compressed-tensors int, bitsandbytes), else None (fp8 ones: dequantized)."""
    folder = Path(folder)
    try:
        scheme = _scheme(folder, _raw_config(folder))
    except ModelLoadError:
        return None  # (load_hf_folder reports it)
    if scheme is None or scheme.method == "fp8" or scheme.bits == 0:  # (fp8: dequantized)
        return None
    return "int8" if scheme.bits == 8 else "int4"


def hf_checkpoint_dtype(folder: str | os.PathLike) -> torch.dtype | None:
    """The half-precision dtype config.json names (torch_dtype, or dtype in transformers v5)."""
    raw = _peeked_config(folder)
    name = raw.get("torch_dtype") or raw.get("dtype")
    if not isinstance(name, str):
        return None  # (absent, or not a dtype name: the default)
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(name)


def hf_model_type(folder: str | os.PathLike) -> str | None:
    """config.json's model_type (None where it cannot say: load_hf_folder reports that)."""
    name = _peeked_config(folder).get("model_type")
    return name if isinstance(name, str) else None


def _peeked_config(folder: str | os.PathLike) -> dict:
    """config.json as _raw_config reads it, {} where it cannot (load_hf_folder reports why)."""
    try:
        return _raw_config(Path(folder))
    except (ModelLoadError, OSError):
        return {}


def _shard_files(folder: Path) -> list[Path]:
    """The safetensors files holding the weights: from the index if there is one."""
    index = folder / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(index, f"invalid index: {exc!r}") from None
        if not isinstance(weight_map, dict):
            raise ModelLoadError(index, "weight_map must be a JSON object")
        names = weight_map.values()
        for name in names:  # (files of this folder: no absolute path, no "..")
            if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
                raise ModelLoadError(index, f"weight_map must name files of the folder: {name!r}")
        files = [folder / name for name in sorted(set(names))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(index, f"lists {f.name}, which does not exist")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        hint = " (.bin/.pt checkpoints are not supported)" if any(folder.glob("*.bin")) else ""
        raise ModelLoadError(folder, f"no *.safetensors weights{hint}")
    return files


def _open_shards(files: list[Path]) -> dict[str, tuple[Path, object]]:
    """name -> (file, open safetensors handle) over every shard."""
    where: dict[str, tuple[Path, object]] = {}
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt")
            names = list(handle.keys())
        except Exception as exc:  # SafetensorError: truncated header, bad JSON, ...
            raise ModelLoadError(f, f"not a readable safetensors file ({exc})") from None
        for name in names:
            where[name] = (f, handle)
    return where


def _mxfp4_tensor(
    name: str, where: dict, dtype: torch.dtype, part: Part | None = None
) -> torch.Tensor:
    """transformers' parameter `name` ([E, K, rows]) from its MXFP4 <name>_blocks and
    <name>_scales, dequantized in dtype (bf16 / fp32; else fp32, converted by the caller).
    part (of the parameter: its last dim = the blocks' rows, the one before = K): only the
    blocks covering it are read (whole 32-blocks along K), and the result narrowed to it."""
    handles = []
    for suffix in ("_blocks", "_scales"):
        path, handle = where.get(name + suffix, (None, None))
        if handle is None:
            raise ModelLoadError(where[name + "_blocks"][0], f"{name}{suffix} is missing")
        handles.append((handle, handle.get_slice(name + suffix), name + suffix))
    shape = handles[1][1].get_shape()  # scales [..., rows, K/32]
    index, offset = None, None
    if part is not None and part.dim >= len(shape) - 2 and part.dim < len(shape):
        # the parameter's dim d is the blocks' dim (last: rows) or (one before: K / 32)
        rows = part.dim == len(shape) - 1
        axis = len(shape) - 2 if rows else len(shape) - 1
        length = shape[axis] if rows else shape[axis] * 32
        if length == part.length:
            start, stop = part.start, part.stop
            if not rows:  # whole 32-blocks
                start, stop = start // 32, -(-stop // 32)
            index = (slice(None),) * axis + (slice(start, stop),)
            offset = None if rows else part.start - start * 32
    elif part is not None and part.dim == 0 and shape[0] == part.length:  # experts (EP)
        index = (slice(part.start, part.stop),)
    parts = [s[index] if index is not None else h.get_tensor(key) for h, s, key in handles]
    out_dtype = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    try:
        whole = dequantize_mxfp4(*parts, out_dtype).transpose(-1, -2)
    except ValueError as exc:
        raise ModelLoadError(where[name + "_blocks"][0], f"{name}: {exc}") from None
    if offset is None:
        return whole
    return whole.narrow(part.dim, offset, part.stop - part.start).contiguous()


def _read_part(handle, key: str, part: Part) -> torch.Tensor:
    """Rows or columns [part.start, part.stop) of a checkpoint tensor, read as a slice (only
    those bytes leave the file); the whole tensor where its length along part.dim is not
    part.length (the shape check then reports it)."""
    sliced = handle.get_slice(key)
    shape = sliced.get_shape()
    if len(shape) <= part.dim or shape[part.dim] != part.length:
        return handle.get_tensor(key)
    return sliced[(slice(None),) * part.dim + (slice(part.start, part.stop),)]


def _check_counts(config: ModelConfig, names, folder: Path) -> None:
    """Refuse a config claiming more layers or experts than the checkpoint has tensors for,
    before expected_shapes lists every tensor of every layer and expert (10^9 layers: a
    MemoryError). gpt-oss stacks its experts: one tensor for them all."""
    keys = {n.removeprefix("model.") for n in names}
    last = config.num_layers - 1
    if not any(k.startswith(f"layers.{last}.") for k in keys):
        problem = f"num_hidden_layers is {config.num_layers}, but it has no tensor of layer {last}"
        raise ModelLoadError(folder, problem)
    expert = f".experts.{config.num_experts - 1}."  # (Mixtral's names end so too)
    if config.num_experts and not config.expert_bias and not any(expert in k for k in keys):
        problem = f"{config.num_experts} experts configured, but it has no tensor of expert "
        raise ModelLoadError(folder, problem + str(config.num_experts - 1))


def _with_quantized(scheme: Scheme, get, locate):
    """get(name, part) returning `<x>.weight` as a QuantizedWeight where the checkpoint holds
    `<x>` packed (fp8 blocks: dequantized); a rank's part cut from the whole weight (rows, or
    columns at group boundaries, an act-order weight's requantized: weight_shards)."""
    if scheme.method == hf_compressed_tensors.METHOD:
        quantized = compressed_getter(scheme, get, locate)
    elif scheme.method == hf_bitsandbytes.METHOD:
        quantized = bitsandbytes_getter(get, locate)
    else:
        quantized = quantized_getter(scheme, get, locate)

    def get_quantized(name: str, part: Part | None = None):
        w = quantized(name)
        if w is None:
            return get(name, part)
        if part is None or w.shape[part.dim] != part.length:
            return w  # (whole: the shape check reports a mismatch)
        if isinstance(w, torch.Tensor):  # (fp8 blocks, dequantized)
            return w.narrow(part.dim, part.start, part.stop - part.start).contiguous()
        if part.dim == 0:
            return rows(w, torch.arange(part.start, part.stop))
        return cols(w, part.start, part.stop, name)

    return get_quantized


def load_hf_folder(
    folder: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    shard: TensorShard | None = None,
    keep_16_bit: bool = False,
) -> tuple[ModelConfig, LlamaWeights, Tokenizer]:
    """Config, weights (on `device` in `dtype`) and tokenizer of a HF model folder; with a
    shard, one tensor-parallel rank's weights, read as safetensors slices (its parts only).
    keep_16_bit: a bf16 / fp16 checkpoint's dense projections stay 16-bit (assemble_weights)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(folder, "no such folder")
    config, norm_offset, scheme = _read_config(folder)
    where = _open_shards(_shard_files(folder))
    _check_counts(config, where, folder)

    def get(name: str, part: Part | None = None) -> torch.Tensor | None:
        # HF checkpoints sometimes drop the "model." prefix (older exports).
        for key in (name, name.removeprefix("model.")):
            if key in where:
                path, handle = where[key]
                try:
                    if part is not None:
                        return _read_part(handle, key, part)
                    return handle.get_tensor(key)
                except Exception as exc:  # data past the end of a truncated file, ...
                    raise ModelLoadError(path, f"tensor {key!r} is unreadable: {exc}") from None
        if name + "_blocks" in where:  # MXFP4 (gpt-oss experts): dequantized, see mxfp4.py
            return _mxfp4_tensor(name, where, dtype, part)
        return None

    def locate(name: str) -> str:  # errors name the shard holding the tensor
        for key in (name, name.removeprefix("model.")):
            if key in where:
                return str(where[key][0])
        return str(folder)

    if scheme is not None:  # pre-quantized: a linear from its quantized tensors
        get = _with_quantized(scheme, get, locate)
    weights = assemble_weights(
        config, get, locate, device, dtype, norm_offset=norm_offset, shard=shard,
        keep_16_bit=keep_16_bit,
    )  # fmt: skip
    return config, weights, Tokenizer.from_folder(folder)
