"""QuantizedWeight: the operand format of the weight-only quantized GEMM (ops.quant_linear, its
reference and kernels). One [N, K] weight (N output channels) in a device-neutral canonical form,
which is also what the weights cache stores:

  int8: qweight int8 [N, K], scales fp32 [N]             w[n, k] = scales[n] * q[n, k]
        (group_size G = 16 or 32: scales fp32 [N, K/G]      w[n, k] = scales[n, k // G] * q[n, k];
        GGUF Q8_0 is G = 32, Q6_K G = 16, exactly; with mins fp32 [N, K/G] as well,
                                                          w[n, k] = scales[n, g] * q + mins[n, g]:
        GGUF Q5_0, Q5_1 and Q5_K exactly, G = 32, q in 0..31)
  int4: qweight uint8 [N, K/2], byte j = q[2j] | q[2j+1] << 4, q in 0..15;
        scales, mins fp16 [N, K/G] (G = group_size, 32 or 128), or fp32 where fp16 cannot hold
        them (GGUF Q4_K's d sc and dmin m: 17 significant bits)
                                                          w[n, k] = scales[n, g] * q + mins[n, g]

Act-order (GPTQ desc_act): its groups are contiguous along K only with the input channels
reordered, so the weight is stored with its K columns in that order and `input_index` int64 [K]
says which input channel each column reads: the GEMM multiplies x[:, input_index] by the stored
weight (every kernel that reads the stored form gathers x so); dequantize_rows puts the columns
back in the input's order, the weight it stands for. None: the columns are the input's order.

Stacked experts (a mixture of experts' [E, N, K] weights, as ops.fused_moe takes them): the
same formats with a leading expert dimension on every part (qweight [E, N, K/2] or [E, N, K],
scales and mins [E, N, K/G] or [E, N]); expert(e) is expert e's [N, K] weight (views).

Kernel-specific packed forms (torch's CPU int4pack, bf16 scales) are built once per weight by
ops.quant_gemm and kept in `packed`. How weights get into this form (quantize-at-load, GGUF
blocks) is the model's business: model/quantized_linear.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True, eq=False)
class QuantizedWeight:
    format: str  # "int8" | "int4"
    shape: tuple[int, ...]  # [N, K] of the weight it stands for ([E, N, K]: stacked experts)
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    group_size: int = 0  # int4: 32 / 128; int8: 0 (per channel), 16 or 32
    packed: dict = field(default_factory=dict)  # kernel key -> packed tensors, made lazily
    input_index: torch.Tensor | None = None  # act-order: the input channel of each column

    def __post_init__(self) -> None:
        index = self.input_index
        if index is not None and (
            len(self.shape) != 2
            or tuple(index.shape) != self.shape[1:]
            or index.dtype != torch.int64
        ):
            raise ValueError(
                f"input_index {index.dtype} {tuple(index.shape)} must be int64 [K] of one [N, K] "
                f"weight {self.shape}"
            )

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        parts = (self.qweight, self.scales, self.mins, self.input_index)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        if self.qweight.device == torch.device(device):
            return self
        mins = None if self.mins is None else self.mins.to(device)
        index = None if self.input_index is None else self.input_index.to(device)
        return QuantizedWeight(
            self.format,
            self.shape,
            self.qweight.to(device),
            self.scales.to(device),
            mins,
            self.group_size,
            input_index=index,
        )

    def gathered(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] as the stored columns read it: x[:, input_index] (x itself without one)."""
        return x if self.input_index is None else x.index_select(-1, self.input_index)

    @property
    def int8_per_group(self) -> bool:
        """int8 with a scale per group along K (group_size 16 / 32), not per channel."""
        return self.format == "int8" and self.group_size > 0

    @property
    def kind(self) -> tuple[str, int, bool]:
        """(format, group_size, whether it has mins): weights fuse or stack as they are only
        when their kinds match."""
        return self.format, self.group_size, self.mins is not None

    @property
    def num_experts(self) -> int | None:
        """E of stacked experts, None for one [N, K] weight."""
        return self.shape[0] if len(self.shape) == 3 else None

    def expert(self, e: int) -> QuantizedWeight:
        """Expert e's [N, K] weight (views of the stacked parts), the same object on every call,
        so the packed forms the kernels build for it are kept."""
        experts = self.packed.setdefault("experts", {})
        if e not in experts:
            mins = None if self.mins is None else self.mins[e]
            experts[e] = QuantizedWeight(
                self.format, self.shape[1:], self.qweight[e], self.scales[e], mins, self.group_size
            )
        return experts[e]

    def unpacked_int4(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """int4: q values as uint8 [N, K] (0..15); of `rows` only: [len(rows), K]."""
        packed = self.qweight if rows is None else self.qweight[rows]
        lo, hi = packed & 15, packed >> 4
        return torch.stack([lo, hi], dim=-1).view(*packed.shape[:-1], self.shape[-1])

    def dequantize_rows(
        self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The float weight (or only `rows` of it: an embedding lookup), in `dtype`; stacked
        experts: [E, N, K] (rows not taken)."""
        if self.num_experts is not None:
            if rows is not None:
                raise ValueError("dequantize_rows takes no rows for stacked experts")
            return torch.stack(
                [self.expert(e).dequantize_rows(dtype=dtype) for e in range(self.shape[0])]
            )
        if rows is not None and rows.device.type == "cpu":  # (CUDA ids: no host read)
            _check_row_ids(rows, self.shape[0])
        stored = self._stored_rows(None if rows is None else rows.long())
        return self.in_input_order(stored).to(dtype)

    def in_input_order(self, stored: torch.Tensor) -> torch.Tensor:
        """[rows, K] in the stored column order -> in the input's (act-order's put back)."""
        if self.input_index is None:
            return stored
        w = torch.empty_like(stored)
        w[:, self.input_index] = stored
        return w

    def _stored_rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        """Rows `rows` (all: None) of the float32 weight, its columns in the stored order."""
        sel = slice(None) if rows is None else rows
        if self.format == "int8":
            q = self.qweight[sel].to(torch.float32)
            scales = self.scales[sel].float()
            if not self.int8_per_group:
                return q * scales[:, None]
            w = q * scales.repeat_interleave(self.group_size, dim=-1)
            if self.mins is not None:
                w += self.mins[sel].float().repeat_interleave(self.group_size, dim=-1)
            return w
        n, k = self.shape
        q = (  # (an embedding lookup unpacks its rows only)
            self.unpacked_int4(rows)
            .to(torch.float32)
            .view(-1, k // self.group_size, self.group_size)
        )
        w = q * self.scales[sel].float()[..., None] + self.mins[sel].float()[..., None]
        return w.reshape(-1, k)

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        bits = 8 if self.format == "int8" else 4  # qmeta: bits, group size, [E,] N, K
        meta = torch.tensor([bits, self.group_size, *self.shape])
        out = {f"{prefix}.qweight": self.qweight, f"{prefix}.scales": self.scales}
        out[f"{prefix}.qmeta"] = meta
        if self.mins is not None:
            out[f"{prefix}.mins"] = self.mins
        if self.input_index is not None:
            out[f"{prefix}.input_index"] = self.input_index
        return out

    @classmethod
    def from_state_dict(cls, prefix: str, sd: dict[str, torch.Tensor]) -> QuantizedWeight | None:
        meta = sd.get(f"{prefix}.qmeta")
        if meta is None:
            return None
        bits, group, *shape = (int(x) for x in meta.tolist())
        fmt = {8: "int8", 4: "int4"}[bits]
        parts = (sd[f"{prefix}.qweight"], sd[f"{prefix}.scales"], sd.get(f"{prefix}.mins"))
        index = sd.get(f"{prefix}.input_index")
        return cls(fmt, tuple(shape), *parts, group, input_index=index)


def _check_row_ids(ids: torch.Tensor, rows: int) -> None:
    """IndexError for ids outside [0, rows) (indexing would wrap a negative one onto a row from
    the end); the message of the CPU backend's C++ rows."""
    bad = (ids < 0) | (ids >= rows)
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise IndexError(
            f"dequantize_rows: ids[{', '.join(map(str, where))}] = {int(ids[where])} is outside "
            f"the weight's {rows} rows"
        )
