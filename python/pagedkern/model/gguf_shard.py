"""One tensor-parallel rank's parts of a GGUF file's tensors (tensor_shard.TensorShard), cut out
of the memory-mapped data before anything is converted or dequantized, so a rank reads and
converts only its part.

Rows are whole rows of blocks. Columns of a block-quantized tensor are whole blocks along each
row: a part whose edges fall inside a block (Q4_K's 256 at Qwen3-30B-A3B's 768 / 2) reads the
blocks covering it, and the converted tensor is narrowed to the part (narrow_columns).

Expert parallelism: a MoE layer's stacked `*_exps` tensors ([E, rows, ...] in numpy order, their
biases [E, rows] too) are cut along the expert dim to the rank's experts (cut_experts), whole
rows of blocks, before any other cut; the part remembers its first expert id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .checkpoint_layout import expected_shapes
from .config import ModelConfig
from .quantized_linear import QuantizedWeight
from .tensor_shard import Part, TensorShard
from .weight_shards import cols


@dataclass(frozen=True, slots=True)
class TensorPart:
    """A part of a GGUF ReaderTensor, with the fields the loader reads of one."""

    name: str
    tensor_type: Any  # GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order (reversed)
    data: np.ndarray  # a view of the mapped file: [..., rows, elements or bytes]
    first_expert: int = 0  # a stack cut to some experts (expert parallelism): the first's id


def shard_tensors(
    tensors: dict, config: ModelConfig, shard: TensorShard, gguf_name
) -> dict[str, tuple[int, int]]:
    """Replace, in `tensors` (GGUF name -> ReaderTensor), every tensor this rank reads a part of
    by that part; return {GGUF name: (offset, width)} for the parts to narrow after conversion.
    gguf_name(HF name) -> the GGUF name holding it (stacked experts: the stack's)."""
    narrow: dict[str, tuple[int, int]] = {}
    for hf_name in expected_shapes(config):
        part = shard.part(config, hf_name)
        name = gguf_name(hf_name)
        if not isinstance(part, Part) or name not in tensors:
            continue
        if isinstance(tensors[name], TensorPart):
            continue  # (a stack: every expert's part is the same)
        cut = _cut(tensors, name, part)
        if cut is not None:
            narrow[name] = cut
    return narrow


def cut_experts(tensors: dict, config: ModelConfig, shard: TensorShard) -> None:
    """Under expert parallelism, replace every stacked expert tensor (blk.N.ffn_*_exps.*) in
    `tensors` by the rank's experts (TensorShard.experts); nothing otherwise."""
    if not shard.expert_parallel or shard.size == 1 or not config.num_experts:
        return
    ids = shard.experts(config)
    for name, t in list(tensors.items()):
        if "_exps." not in name or isinstance(t, TensorPart):
            continue
        logical = [int(x) for x in reversed(t.shape)]  # numpy order: [E, ...]
        if logical[0] != config.num_experts:
            continue  # read whole: the shape check reports it
        logical[0] = len(ids)
        data = t.data[ids.start : ids.stop]
        tensors[name] = TensorPart(name, t.tensor_type, tuple(reversed(logical)), data, ids.start)


def cut_tensors(tensors: dict, parts: dict[str, Part]) -> dict[str, tuple[int, int]]:
    """As shard_tensors, for parts given by GGUF name (dims counted as in _cut: rows and columns
    of the last two dimensions), for tensors that do not map one-to-one onto a HF one."""
    narrow: dict[str, tuple[int, int]] = {}
    for name, part in parts.items():
        if name in tensors and not isinstance(tensors[name], TensorPart):
            cut = _cut(tensors, name, part)
            if cut is not None:
                narrow[name] = cut
    return narrow


def _cut(tensors: dict, name: str, part: Part) -> tuple[int, int] | None:
    from gguf.constants import GGML_QUANT_SIZES

    t = tensors[name]
    logical = [int(x) for x in reversed(t.shape)]  # numpy order, in elements
    axis = part.dim + len(logical) - (1 if len(logical) == 1 else 2)
    if logical[axis] != part.length:
        return None  # read whole: the shape check reports it
    start, stop, offset = part.start, part.stop, None
    index = [slice(None)] * t.data.ndim
    if axis < len(logical) - 1:  # rows
        index[axis] = slice(start, stop)
    else:  # columns: whole blocks along each row
        block, size = (1, t.data.dtype.itemsize)
        if t.data.dtype == np.uint8:
            block, size = GGML_QUANT_SIZES[t.tensor_type]
        first, last = start // block * block, -(-stop // block) * block
        index[axis] = slice(first // block * size, last // block * size)
        if (first, last) != (start, stop):
            offset = (start - first, stop - start)
        start, stop = first, last
        if t.data.dtype != np.uint8:
            index[axis] = slice(start, stop)
    logical[axis] = stop - start
    data = t.data[tuple(index)]
    tensors[name] = TensorPart(name, t.tensor_type, tuple(reversed(logical)), data)
    return offset


def narrow_columns(w, offset: int, width: int, what: str):
    """Columns [offset, offset + width) of a converted tensor read in whole blocks (a float
    tensor, or a QuantizedWeight: int8 any columns, int4 at its group boundaries)."""
    if isinstance(w, QuantizedWeight):
        return cols(w, offset, offset + width, what)
    return w[..., offset : offset + width].contiguous()
