"""Which part of every weight one tensor-parallel rank holds (Megatron-style), as ranges of
checkpoint tensors under HF names: the loaders read only these parts (safetensors slices, GGUF
tensor slices), and weight_shards.shard_weights cuts the same parts out of weights loaded whole.

Column-parallel (output rows split): Q/K/V (this rank's query heads and their KV heads) and
gate/up (this rank's slice of the intermediate size), of the dense MLP, of every expert (its
moe_intermediate_size) and of the shared expert (its own size). Row-parallel (input columns
split): O and down, whose partial outputs the forward all-reduces (after the experts' combine in
a MoE layer: the combine and the shared expert's gate are linear in them); their biases stay on
rank 0 only, so the sum adds them once. Vocab-parallel: rank r holds embedding / LM head rows
[r*ceil(V/N), (r+1)*ceil(V/N)). Norms, RoPE factors, routers (gpt-oss's bias too) and the
shared-expert gate are replicated. gpt-oss: each rank holds its query heads' sinks; its stacked
experts (checkpoint layout [E, H, 2I] with gate / up columns interleaved, their bias [E, 2I],
down [E, I, H]) are cut along the intermediate size as every expert is (interleaved, a rank's
slice is one run of columns [2a, 2b)); the down bias is rank 0's.

KV heads: with num_kv_heads >= N each rank holds num_kv_heads / N of them; with fewer (as vLLM
does) each rank holds the one KV head its query heads read, replicated over N / num_kv_heads
ranks.

Expert parallel (expert_parallel=True, over the same N ranks): attention, dense MLPs, the shared
expert and the vocabulary are split as above, but a MoE layer's experts are not cut: rank r holds
experts expert_range(E, r, N) whole (E not divisible by N: the first E mod N ranks hold one more,
vLLM's linear placement), their biases with them; the router stays replicated. Every other
expert's tensors are DROPPED (never read); gpt-oss's stacked tensors are read along dim 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config import ModelConfig

DROPPED = "dropped"  # TensorShard.part: a row-parallel bias left to rank 0, another rank's expert


class TensorParallelConfigError(ValueError):
    """This model cannot be split over this many ranks (the message says why)."""


@dataclass(frozen=True, slots=True)
class Part:
    """Rows (dim 0) or columns (dim 1) [start, stop) of a tensor `length` long along `dim`
    (dim 2: the columns of a stacked checkpoint tensor [E, rows, columns], gpt-oss's)."""

    dim: int
    start: int
    stop: int
    length: int

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        """The part's shape, of a tensor of shape `full`."""
        return tuple(self.stop - self.start if d == self.dim else n for d, n in enumerate(full))


def expert_range(num_experts: int, rank: int, size: int) -> range:
    """The expert ids rank `rank` of `size` holds under expert parallelism: E // N each, the
    first E % N ranks one more (contiguous, in rank order)."""
    base, extra = divmod(num_experts, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def check_tp_size(config: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Refuse a size the heads (or an MLP's size) do not divide, naming the counts; under
    expert parallelism, fewer experts than ranks."""
    hq, hkv = config.num_heads, config.num_kv_heads
    if size < 1:
        raise TensorParallelConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    if hq % size:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {size} does not divide {config.name}'s {hq} query heads "
            f"(divisors: {', '.join(str(d) for d in range(1, hq + 1) if hq % d == 0)})"
        )
    if (hkv >= size and hkv % size) or (hkv < size and size % hkv):
        raise TensorParallelConfigError(
            f"tensor_parallel_size {size} and {config.name}'s {hkv} KV heads: one must divide "
            "the other (KV heads are split, or replicated when fewer than the ranks)"
        )
    if config.qk_norm_whole:
        raise TensorParallelConfigError(
            f"{config.name}'s QK-norm spans the whole projection (OLMoE), which tensor "
            "parallelism does not split yet; use tensor_parallel_size 1"
        )
    if expert_parallel and 0 < config.num_experts < size:
        raise TensorParallelConfigError(
            f"expert parallelism over {size} ranks: {config.name} has only "
            f"{config.num_experts} experts (a rank would hold none); use at most "
            f"{config.num_experts} ranks or tensor parallelism alone"
        )
    dense = not config.num_experts or config.dense_layers
    sizes = [("intermediate size", config.intermediate_size if dense else 0)]
    if not expert_parallel:  # (whole experts: their size is not split)
        sizes += [("experts' intermediate size", config.moe_intermediate_size)]
    sizes += [("shared expert's intermediate size", config.shared_expert_size)]
    for what, n in sizes:
        if n % size:
            raise TensorParallelConfigError(
                f"tensor_parallel_size {size} does not divide the {what} {n}"
            )


@dataclass(frozen=True, slots=True)
class TensorShard:
    """Rank `rank` of `size`: its config and the part of each checkpoint tensor it reads
    (expert_parallel: whole experts, expert_range's, in MoE layers)."""

    rank: int
    size: int
    expert_parallel: bool = False

    def check(self, config: ModelConfig) -> None:
        check_tp_size(config, self.size, self.expert_parallel)
        if not 0 <= self.rank < self.size:
            raise TensorParallelConfigError(f"rank {self.rank} out of range for size {self.size}")

    def config(self, config: ModelConfig) -> ModelConfig:
        """The shape this rank computes: its heads, MLP slices and vocabulary rows."""
        self.check(config)
        if self.size == 1:
            return config
        return config.replace(
            num_heads=config.num_heads // self.size,
            num_kv_heads=max(1, config.num_kv_heads // self.size),
            intermediate_size=config.intermediate_size // self.size,
            moe_intermediate_size=config.moe_intermediate_size
            // (1 if self.expert_parallel else self.size),
            shared_expert_size=config.shared_expert_size // self.size,
            vocab_size=len(self.vocab(config)),
        )

    # --- ranges of the fused dimensions -------------------------------------------------------
    def kv_heads(self, config: ModelConfig) -> range:
        """The global KV head ids this rank holds (one replicated head when they are fewer)."""
        hkv, size = config.num_kv_heads, self.size
        if hkv >= size:
            per = hkv // size
            return range(self.rank * per, (self.rank + 1) * per)
        head = self.rank * hkv // size
        return range(head, head + 1)

    def heads(self, config: ModelConfig) -> range:
        """The global query head ids this rank holds."""
        per = config.num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def q_rows(self, config: ModelConfig) -> range:
        per = config.num_heads // self.size * config.head_dim
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_rows(self, config: ModelConfig) -> range:
        heads, d = self.kv_heads(config), config.head_dim
        return range(heads.start * d, heads.stop * d)

    def mlp_rows(self, intermediate: int) -> range:
        """This rank's slice of an MLP of `intermediate` (gate and up rows, down columns)."""
        per = intermediate // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def experts(self, config: ModelConfig) -> range:
        """The expert ids this rank holds (all of them unless expert parallel)."""
        if not self.expert_parallel:
            return range(config.num_experts)
        return expert_range(config.num_experts, self.rank, self.size)

    def vocab(self, config: ModelConfig) -> range:
        shard = -(-config.vocab_size // self.size)
        rows = range(self.rank * shard, min(config.vocab_size, (self.rank + 1) * shard))
        if len(rows) == 0:
            raise TensorParallelConfigError(
                f"vocabulary {config.vocab_size} too small for {self.size} ranks"
            )
        return rows

    # --- checkpoint tensors (HF names) --------------------------------------------------------
    def part(self, config: ModelConfig, name: str) -> Part | str | None:
        """The part of checkpoint tensor `name` (HF names, Mixtral's expert names too) this
        rank reads: a Part, None (all of it) or DROPPED (a row-parallel bias: rank 0's; under
        expert parallelism, another rank's expert).
        Raises for a layer tensor no rule covers (a model tensor parallelism does not split)."""
        if self.size == 1:
            return None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return _part(0, self.vocab(config), config.vocab_size)
        parts = name.split(".")
        if parts[:2] != ["model", "layers"]:
            return None  # the final norm
        proj, kind = parts[-2], parts[-1]
        if proj == "router":  # gpt-oss's router, weight and bias
            return None
        if kind == "sinks":  # one per query head
            return _part(0, self.heads(config), config.num_heads)
        if proj == "experts" and kind in _GPT_OSS_EXPERTS:  # gpt-oss's stacked experts
            if self.expert_parallel:  # [E, ...]: this rank's experts, biases too
                return _part(0, self.experts(config), config.num_experts)
            return self._gpt_oss_expert_part(config, kind)
        if self.expert_parallel and ".experts." in name:  # one expert's tensor: its or none
            e = int(name.split(".experts.")[1].split(".")[0])
            return None if e in self.experts(config) else DROPPED
        proj = _MIXTRAL_EXPERT.get(proj, proj) if ".experts." in name else proj
        if proj in _REPLICATED and kind == "weight":
            return None
        if proj in ("q_proj", "k_proj", "v_proj"):
            if proj == "q_proj":
                return _part(0, self.q_rows(config), config.q_size)
            return _part(0, self.kv_rows(config), config.kv_size)
        if proj == "o_proj":
            if kind == "bias":
                return None if self.rank == 0 else DROPPED
            return _part(1, self.q_rows(config), config.q_size)
        if proj not in ("gate_proj", "up_proj", "down_proj"):
            raise TensorParallelConfigError(
                f"tensor {name!r}: tensor parallelism has no rule to split it; use "
                "tensor_parallel_size 1"
            )
        if ".experts." in name:
            intermediate = config.moe_intermediate_size
        elif ".shared_expert." in name:
            intermediate = config.shared_expert_size
        else:
            intermediate = config.intermediate_size
        if proj != "down_proj":
            return _part(0, self.mlp_rows(intermediate), intermediate)
        if kind == "bias":
            return None if self.rank == 0 else DROPPED
        return _part(1, self.mlp_rows(intermediate), intermediate)

    def _gpt_oss_expert_part(self, config: ModelConfig, kind: str) -> Part | str | None:
        inter = config.moe_intermediate_size
        rows = self.mlp_rows(inter)
        if kind == "down_proj_bias":
            return None if self.rank == 0 else DROPPED
        if kind == "down_proj":  # [E, I, H]
            return Part(1, rows.start, rows.stop, inter)
        dim = 2 if kind == "gate_up_proj" else 1  # [E, H, 2I] / bias [E, 2I]
        return Part(dim, 2 * rows.start, 2 * rows.stop, 2 * inter)

    def reader(
        self, config: ModelConfig, get: Callable, shapes: dict[str, tuple[int, ...]]
    ) -> tuple[Callable, dict[str, tuple[int, ...]]]:
        """(get(name) reading this rank's part: get_part(name, Part) for a sliced tensor, and
        `shapes` (HF name -> whole shape) as this rank's parts, DROPPED ones left out) for a
        loader whose get_part(name, part=None) slices the checkpoint tensor as it reads it
        (returning it whole where its length along part.dim is not part.length, for the
        shape check to report)."""
        self.check(config)
        local: dict[str, tuple[int, ...]] = {}
        for name, shape in shapes.items():
            part = self.part(config, name)
            if part != DROPPED:
                local[name] = shape if part is None else part.shape(shape)

        def get_part(name: str):
            part = self.part(config, name)
            if part == DROPPED:
                return None
            return get(name) if part is None else get(name, part)

        return get_part, local


# Layer tensors every rank holds whole (their HF names' last component but one)
_REPLICATED = {
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "q_norm",
    "k_norm",
    "gate",  # the router
    "shared_expert_gate",
}
_GPT_OSS_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _part(dim: int, rows: range, length: int) -> Part:
    return Part(dim, rows.start, rows.stop, length)
