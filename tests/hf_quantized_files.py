"""Pre-quantized HF folders written for the tests: tiny transformers models whose linear
weights are quantized here and packed the way AutoGPTQ / GPTQModel and AutoAWQ pack them (from
those formats' descriptions, independently of the loader), as compressed-tensors stores them,
or as transformers' fine-grained FP8; the transformers model keeps the dequantized weights, the
reference."""

from __future__ import annotations

import json

import pytest
import torch
from hf_model_files import write_tokenizer
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

PROMPT = [5, 77, 301, 12, 250, 9, 33, 120, 64, 7, 199, 3, 42, 318, 91, 17, 260, 88]

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column 8j + this


def tiny_model(arch: str = "llama"):
    torch.manual_seed(0)
    common = dict(
        vocab_size=400, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    if arch == "qwen2":  # (attention biases beside the packed weights)
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).float().eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).float().eval()


def quantize(w: torch.Tensor, bits: int, group: int, sym: bool, min_zero: int = 0):
    """GPTQ / AWQ style round-to-nearest of w [N, K]: (codes [K, N], zeros [K / G, N],
    fp16 scales [K / G, N], the dequantized weight [N, K])."""
    n, k = w.shape
    group = k if group == -1 else group
    top = (1 << bits) - 1
    g = w.reshape(n, k // group, group)
    if sym:
        scale = (g.abs().amax(-1) / (top // 2)).half().float()
        zero = torch.full_like(scale, (top + 1) // 2)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / top).half().float()
        zero = (-lo / scale).round().clamp(min_zero, top)
    q = (g / scale[..., None]).round() + zero[..., None]
    q = q.clamp(0, top)
    deq = (scale[..., None] * (q - zero[..., None])).reshape(n, k)
    codes = q.reshape(n, k).t().to(torch.int32).contiguous()
    return codes, zero.t().to(torch.int32).contiguous(), scale.t().half().contiguous(), deq


def quantize_in_order(w: torch.Tensor, bits: int, group: int, sym: bool, min_zero: int, order):
    """quantize() with GPTQ's g_idx: in act-order (order: the input channels in the order they
    were quantized, their groups filled in that order) the codes, values and groups come back
    in the input's order. (codes, zeros, scales, dequantized, g_idx)."""
    k = w.shape[1]
    codes, zeros, scales, deq = quantize(
        w if order is None else w[:, order], bits, group, sym, min_zero
    )
    g_idx = torch.arange(k, dtype=torch.int32) // (k if group == -1 else group)
    if order is not None:
        back = torch.argsort(order)
        codes, deq, g_idx = codes[back].contiguous(), deq[:, back], g_idx[back].contiguous()
    return codes, zeros, scales, deq, g_idx


SAME_INPUT = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "gate_proj": "mlp",
    "up_proj": "mlp",
}


def shared_orders(seed: int = 0):
    """orders(name, K) as GPTQ makes them: one order per input (Q, K and V read the same
    activations, so do gate and up), each a random permutation."""
    made: dict[str, torch.Tensor] = {}

    def order(name: str, k: int) -> torch.Tensor:
        layer, short = name.rsplit(".", 1)
        key = layer.rsplit(".", 1)[0] + "." + SAME_INPUT.get(short, short)
        if key not in made:
            generator = torch.Generator().manual_seed(seed + len(made))
            made[key] = torch.randperm(k, generator=generator)
        return made[key]

    return order


def pack_gptq(codes, zeros, bits: int, v1: bool):
    """AutoGPTQ's layout: codes packed along K (rows), zeros along N; v1 stores zero - 1."""
    p = 32 // bits
    mask = (1 << bits) - 1
    qweight = torch.zeros(codes.shape[0] // p, codes.shape[1], dtype=torch.int32)
    for i in range(p):
        qweight |= (codes[i::p] & mask) << (bits * i)
    stored = zeros - 1 if v1 else zeros
    qzeros = torch.zeros(zeros.shape[0], zeros.shape[1] // p, dtype=torch.int32)
    for i in range(p):
        qzeros |= (stored[:, i::p] & mask) << (bits * i)
    return qweight, qzeros


def pack_awq(codes, zeros):
    """AutoAWQ's GEMM layout: codes and zeros packed along N in AWQ_PACK_ORDER."""

    def pack(m):
        out = torch.zeros(m.shape[0], m.shape[1] // 8, dtype=torch.int32)
        for i, column in enumerate(AWQ_PACK_ORDER):
            out |= (m[:, column::8] & 0xF) << (4 * i)
        return out

    return pack(codes), pack(zeros)


SCHEMES = {
    "gptq-int4-sym-g128": dict(quant_method="gptq", bits=4, group_size=128, sym=True),
    "gptq-int4-asym-g32": dict(quant_method="gptq", bits=4, group_size=32, sym=False),
    "gptq_v2-int4-asym-g64": dict(
        quant_method="gptq", bits=4, group_size=64, sym=False, checkpoint_format="gptq_v2"
    ),
    "gptq-int4-sym-per-row": dict(quant_method="gptq", bits=4, group_size=-1, sym=True),
    "gptq-int8-sym-g128": dict(quant_method="gptq", bits=8, group_size=128, sym=True),
    "awq-int4-g128": dict(quant_method="awq", bits=4, group_size=128, zero_point=True),
    "awq-int4-g64": dict(quant_method="awq", bits=4, group_size=64, zero_point=True),
}


def write_quantized(folder, hf, qc: dict, lm_head: bool = False, orders=None) -> None:
    """hf's linears quantized per qc, packed in qc's format, with the rest of its tensors, as
    an HF folder; hf's weights replaced by the dequantized ones (the reference). orders(name,
    K): GPTQ act-order, the input channels in the order they were quantized (their groups
    filled in that order, as g_idx then says), or None for k // G."""
    qc = {"desc_act": orders is not None, **qc}
    bits, group, awq = qc["bits"], qc["group_size"], qc["quant_method"] == "awq"
    v1 = not awq and qc.get("checkpoint_format", "gptq") == "gptq"
    tensors = {}
    with torch.no_grad():
        for name, module in hf.named_modules():
            short = name.rsplit(".", 1)[-1]
            if short not in LINEARS and not (lm_head and short == "lm_head"):
                continue
            sym = qc.get("sym", False)
            order = None if orders is None else orders(name, module.weight.shape[1])
            codes, zeros, scales, deq, g_idx = quantize_in_order(
                module.weight, bits, group, sym, int(v1), order
            )
            module.weight.copy_(deq)
            if awq:
                qweight, qzeros = pack_awq(codes, zeros)
            else:
                qweight, qzeros = pack_gptq(codes, zeros, bits, v1)
                tensors[f"{name}.g_idx"] = g_idx
            tensors.update({f"{name}.qweight": qweight, f"{name}.qzeros": qzeros})
            tensors[f"{name}.scales"] = scales
        quantized = {n.removesuffix("qweight") + "weight" for n in tensors if "qweight" in n}
        for name, t in hf.state_dict().items():
            if name not in quantized:
                tensors[name] = t.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(config))
    write_tokenizer(folder)


def tiny_moe(tmp_path, moe_intermediate_size: int = 64, arch: str = "qwen3_moe"):
    """A tiny Qwen3-MoE or Mixtral (4 experts, 2 a token), saved as transformers saves it in
    tmp_path / "float": (the model, its tensors as stored: each expert's projections by name,
    Mixtral's block_sparse_moe.experts.<e>.w1 / w3 / w2)."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=400, hidden_size=128, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    if arch == "mixtral":
        config = transformers.MixtralConfig(
            **common, intermediate_size=moe_intermediate_size, num_local_experts=4
        )
        hf = transformers.MixtralForCausalLM(config).float().eval()
    else:
        config = transformers.Qwen3MoeConfig(
            **common, intermediate_size=256, moe_intermediate_size=moe_intermediate_size,
            num_experts=4, norm_topk_prob=True,
        )  # fmt: skip
        hf = transformers.Qwen3MoeForCausalLM(config).float().eval()
    hf.save_pretrained(tmp_path / "float", safe_serialization=True)
    return hf, load_file(str(tmp_path / "float" / "model.safetensors"))


def moe_reference(tmp_path, plain: dict):
    """The transformers model of tiny_moe's folder with its tensors replaced by `plain` (the
    dequantized ones)."""
    save_file(plain, str(tmp_path / "float" / "model.safetensors"))
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "float").eval()


def write_moe_gptq(tmp_path, orders=None):
    """A tiny Qwen3-MoE as GPTQ ships it (every expert's projections packed, the router float;
    orders: as write_quantized's) in tmp_path / "gptq", and (the folder, the transformers model
    holding the dequantized weights)."""
    hf, tensors = tiny_moe(tmp_path)
    config = hf.config
    packed, plain = {}, dict(tensors)
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            order = None if orders is None else orders(name.removesuffix(".weight"), w.shape[1])
            codes, zeros, scales, deq, g_idx = quantize_in_order(w, 4, 32, False, 1, order)
            plain[name] = deq.contiguous()
            stem = name.removesuffix("weight")
            qweight, qzeros = pack_gptq(codes, zeros, 4, v1=True)
            packed |= {stem + "qweight": qweight, stem + "qzeros": qzeros, stem + "scales": scales}
            packed[stem + "g_idx"] = g_idx
        else:
            packed[name] = w
    folder = tmp_path / "gptq"
    folder.mkdir()
    save_file(packed, str(folder / "model.safetensors"))
    qc = SCHEMES["gptq-int4-asym-g32"] | {"desc_act": orders is not None}
    (folder / "config.json").write_text(json.dumps(config.to_dict() | {"quantization_config": qc}))
    write_tokenizer(folder)
    return folder, moe_reference(tmp_path, plain)


def linears_of(hf, tensors: dict):
    """(name, module) of hf's quantizable linears, each one's float weight taken out of
    `tensors` (its state dict) for the quantized parts to replace."""
    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] in LINEARS:
            del tensors[f"{name}.weight"]
            yield name, module


def assert_layer_holds(layer, hf, index: int) -> None:
    """The loaded layer's QKV, down and up (dequantized where quantized) equal hf's layer
    `index` bit for bit."""

    def plain(w):
        return w if isinstance(w, torch.Tensor) else w.dequantize_rows()

    attn, mlp = hf.model.layers[index].self_attn, hf.model.layers[index].mlp
    want_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(plain(layer.qkv), want_qkv)
    assert torch.equal(plain(layer.down), mlp.down_proj.weight)
    assert torch.equal(plain(layer.gate_up)[mlp.up_proj.weight.shape[0] :], mlp.up_proj.weight)


def cpu_logits(folder) -> tuple:
    """(the folder's model, loaded in float32 on the CPU backend; its float64 logits over
    PROMPT)."""
    from hf_model_files import all_logits

    from pagedkern import ops
    from pagedkern.model import load_model

    with ops.use_backend("cpu"):
        model, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
        return model, all_logits(model, PROMPT).double()


def reference_logits(hf) -> torch.Tensor:
    """transformers' float64 logits over PROMPT."""
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0].double()


def engine_greedy(folder, max_tokens: int = 12) -> list[int]:
    """The CPU backend engine's greedy tokens for PROMPT from the model in `folder`."""
    from pagedkern.engine import Engine, EngineConfig, SamplingParams

    engine = Engine.from_config(
        EngineConfig(model=str(folder), backend="cpu", num_blocks=64, block_size=4)
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.add_request(prompt_ids=PROMPT, params=params)
    return [t for o in engine.run_until_done() for t in o.token_ids]


def fp8_blocks(w: torch.Tensor, bn: int, bk: int):
    """w [N, K] as E4M3 with an fp32 scale per block of [bn, bk] (the blocks' largest weight
    at 448): (fp8 weight, scales [ceil(N / bn), ceil(K / bk)], the dequantized weight)."""
    n, k = w.shape
    scales = torch.empty(-(-n // bn), -(-k // bk))
    fp8 = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    deq = torch.empty(n, k)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            scales[i, j] = w[rows, cols].abs().amax() / 448
            fp8[rows, cols] = (w[rows, cols] / scales[i, j]).to(torch.float8_e4m3fn)
            deq[rows, cols] = fp8[rows, cols].float() * scales[i, j]
    return fp8, scales, deq


def write_fp8(folder, hf, block: list[int], config: bool = True) -> None:
    """hf's linears as transformers' fine-grained FP8 (E4M3 weights, an fp32 weight_scale_inv
    per block of `block`), hf's weights replaced by the dequantized ones."""
    tensors = {n: t.contiguous() for n, t in hf.state_dict().items()}
    with torch.no_grad():
        for name, module in linears_of(hf, tensors):
            fp8, scales, deq = fp8_blocks(module.weight, *block)
            module.weight.copy_(deq)
            tensors[f"{name}.weight"] = fp8
            tensors[f"{name}.weight_scale_inv"] = scales
    save_file(tensors, str(folder / "model.safetensors"))
    hf_config = hf.config.to_dict()
    if config:
        hf_config["quantization_config"] = {
            "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block,
        }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(hf_config))
    write_tokenizer(folder)


# compressed-tensors schemes as llm-compressor writes them (format, weights' type, bits,
# group: -1 a row, "block": [bn, bk], symmetric); W8A8 quantizes activations too (not here)
COMPRESSED_TENSORS = {
    "w4a16-sym-g128": ("pack-quantized", "int", 4, 128, True),
    "w4a16-asym-g32": ("pack-quantized", "int", 4, 32, False),
    "w4a16-sym-channel": ("pack-quantized", "int", 4, -1, True),
    "w8a16-sym-g32": ("pack-quantized", "int", 8, 32, True),
    "w8a16-sym-channel": ("pack-quantized", "int", 8, -1, True),
    "w8a8-int-channel": ("int-quantized", "int", 8, -1, True),
    "fp8-channel": ("float-quantized", "float", 8, -1, True),
    "fp8-block": ("float-quantized", "float", 8, [48, 64], True),
}


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' dense int32 packing of unsigned codes [R, C] along C: code i at
    bits (i % p) * bits of word i // p, p = 32 / bits."""
    p = 32 // bits
    words = torch.zeros(codes.shape[0], codes.shape[1] // p, dtype=torch.int32)
    for i in range(p):
        words |= (codes[:, i::p].to(torch.int32) & ((1 << bits) - 1)) << (bits * i)
    return words


def compress_linear(w: torch.Tensor, scheme: str, order=None, scale_dtype=torch.bfloat16):
    """w [N, K] in a compressed-tensors scheme (COMPRESSED_TENSORS; order: actorder "group"'s
    input order, weight_g_idx stored): (its tensors under `weight...` names, the dequantized
    weight). A group past K (moe down_proj's few inputs) is the row's one, as
    compressed-tensors makes ceil(K / G) groups."""
    fmt, kind, bits, group, sym = COMPRESSED_TENSORS[scheme]
    if kind == "float":
        bn, bk = group if group != -1 else (1, w.shape[1])
        fp8, scales, deq = fp8_blocks(w, bn, bk)
        return {"weight": fp8, "weight_scale": scales}, deq
    group = -1 if group >= w.shape[1] else group
    codes, zeros, scales, _, g_idx = quantize_in_order(w, bits, group, sym, 0, order)
    stored = scales.to(scale_dtype)  # [K / G, N]
    at = g_idx.long()
    deq = stored.float()[at].t() * (codes.t().float() - zeros.float()[at].t())
    out = {}
    if fmt == "int-quantized":
        out["weight"] = (codes.t() - 128).to(torch.int8).contiguous()
    else:
        out["weight_packed"] = pack_rows(codes.t(), bits)
        out["weight_shape"] = torch.tensor(list(w.shape))
        if not sym:  # (packed along N)
            out["weight_zero_point"] = pack_rows(zeros, bits).t().contiguous()
        if order is not None:
            out["weight_g_idx"] = g_idx
    out["weight_scale"] = stored.t().contiguous()
    return out, deq


def compressed_tensors_config(scheme: str, act_order: bool = False, ignore=("lm_head",)):
    """The quantization_config llm-compressor writes for `scheme` on Linear targets, `ignore`
    the modules it left in float (compressed-tensors lists each by name)."""
    fmt, kind, bits, group, sym = COMPRESSED_TENSORS[scheme]
    weights = {
        "num_bits": bits, "type": kind, "symmetric": sym, "dynamic": False,
        "strategy": "channel" if group == -1 else "block" if kind == "float" else "group",
        "group_size": None if group == -1 or kind == "float" else group,
        "block_structure": group if kind == "float" and group != -1 else None,
        "actorder": "group" if act_order else None,
    }  # fmt: skip
    activations = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": True,
                   "strategy": "token"} if scheme.startswith(("w8a8", "fp8")) else None  # fmt: skip
    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": activations, "format": fmt}},
        "ignore": list(ignore), "kv_cache_scheme": None, "sparsity_config": {},
    }  # fmt: skip


def write_compressed_tensors(folder, hf, scheme: str, orders=None, scale_dtype=torch.bfloat16):
    """hf's linears in a compressed-tensors scheme (COMPRESSED_TENSORS), scales in
    scale_dtype, orders: actorder "group" (as write_quantized's, with weight_g_idx); hf's
    weights replaced by the dequantized ones."""
    tensors = {n: t.contiguous() for n, t in hf.state_dict().items()}
    with torch.no_grad():
        for name, module in linears_of(hf, tensors):
            w = module.weight
            order = None if orders is None else orders(name, w.shape[1])
            out, deq = compress_linear(w, scheme, order, scale_dtype)
            module.weight.copy_(deq)
            tensors |= {f"{name}.{part}": t for part, t in out.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    qc = compressed_tensors_config(scheme, orders is not None)
    (folder / "config.json").write_text(
        json.dumps(hf.config.to_dict() | {"quantization_config": qc})
    )
    write_tokenizer(folder)


MOE_PROJECTIONS = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")


def write_moe_compressed_tensors(
    tmp_path, scheme: str, orders=None, moe_intermediate_size: int = 64, arch: str = "qwen3_moe"
):
    """tiny_moe as llm-compressor ships it in `scheme` (every expert's and the attention's
    projections quantized; each layer's router left float and listed in `ignore` by name, as
    its MoE recipes' "re:.*mlp.gate$" / "re:.*block_sparse_moe.gate" leave it, and lm_head;
    orders: as write_quantized's) in tmp_path / scheme: (the folder, the transformers model
    holding the dequantized weights)."""
    hf, tensors = tiny_moe(tmp_path, moe_intermediate_size, arch)
    stored, plain = {}, dict(tensors)
    for name, w in tensors.items():
        if not name.endswith(MOE_PROJECTIONS):
            stored[name] = w
            continue
        stem = name.removesuffix("weight")
        order = None if orders is None else orders(stem[:-1], w.shape[1])
        out, deq = compress_linear(w, scheme, order)
        plain[name] = deq.contiguous()
        stored |= {stem + part: t for part, t in out.items()}
    folder = tmp_path / scheme
    folder.mkdir()
    save_file(stored, str(folder / "model.safetensors"))
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    routers = [f"model.layers.{n}.{block}.gate" for n in range(hf.config.num_hidden_layers)]
    qc = compressed_tensors_config(scheme, orders is not None, [*routers, "lm_head"])
    (folder / "config.json").write_text(
        json.dumps(hf.config.to_dict() | {"quantization_config": qc})
    )
    write_tokenizer(folder)
    return folder, moe_reference(tmp_path, plain)


# bitsandbytes' NF4 table (QLoRA's normal-float quantiles)
NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]  # fmt: skip


def bnb_4bit(w: torch.Tensor, block: int = 64, nested: bool = True) -> tuple[dict, torch.Tensor]:
    """w [N, K] as bitsandbytes saves an NF4 Linear4bit's weight (nested: its absmax
    double-quantized to uint8 over a 256-value map, 256 a block): (its tensors under
    `weight...` names, the weight they hold, computed as bitsandbytes dequantizes it)."""
    n, k = w.shape
    code = torch.tensor(NF4)
    flat = w.reshape(-1, block)
    absmax = flat.abs().amax(dim=1)
    q = torch.bucketize(flat / absmax[:, None], (code[:-1] + code[1:]) / 2).reshape(-1)
    packed = ((q[0::2] << 4) | q[1::2]).to(torch.uint8)[:, None]
    meta = {"quant_type": "nf4", "blocksize": block, "dtype": "bfloat16", "shape": [n, k]}
    out = {"weight": packed, "weight.quant_map": code}
    if nested:
        offset = absmax.mean()
        nested_code = torch.linspace(-1, 1, 256)
        centred = absmax - offset
        nested_max = torch.stack([part.abs().amax() for part in centred.split(256)])
        at = torch.arange(absmax.numel()) // 256
        mid = (nested_code[:-1] + nested_code[1:]) / 2
        absmax_q = torch.bucketize(centred / nested_max[at], mid).to(torch.uint8)
        absmax = nested_code[absmax_q.long()] * nested_max[at] + offset
        meta |= {"nested_blocksize": 256, "nested_dtype": "float32",
                 "nested_offset": offset.item()}  # fmt: skip
        out |= {"weight.absmax": absmax_q, "weight.nested_absmax": nested_max,
                "weight.nested_quant_map": nested_code}  # fmt: skip
    else:
        out["weight.absmax"] = absmax
    out["weight.quant_state.bitsandbytes__nf4"] = torch.tensor(
        list(json.dumps(meta).encode()), dtype=torch.uint8
    )
    deq = (code[q] * absmax.repeat_interleave(block)).reshape(n, k)
    return out, deq


def write_bitsandbytes(folder, hf, bits: int = 4, nested: bool = True) -> None:
    """hf's linears as transformers saves a load_in_4bit (NF4) or load_in_8bit model, hf's
    weights replaced by the ones the tensors hold (the 4-bit ones as bitsandbytes computes
    them, in fp32)."""
    tensors = {n: t.contiguous() for n, t in hf.state_dict().items()}
    with torch.no_grad():
        for name, module in linears_of(hf, tensors):
            w = module.weight
            if bits == 4:
                parts, deq = bnb_4bit(w, nested=nested)
            else:
                scb = w.abs().amax(dim=1)
                cb = torch.round(w * 127 / scb[:, None]).to(torch.int8)
                parts, deq = {"weight": cb, "SCB": scb}, cb.float() * (scb[:, None] / 127)
            module.weight.copy_(deq)
            tensors |= {f"{name}.{part}": t.contiguous() for part, t in parts.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    qc = {"quant_method": "bitsandbytes", f"load_in_{bits}bit": True,
          "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": nested,
          "bnb_4bit_compute_dtype": "bfloat16", "llm_int8_skip_modules": ["lm_head"]}  # fmt: skip
    (folder / "config.json").write_text(
        json.dumps(hf.config.to_dict() | {"quantization_config": qc})
    )
    write_tokenizer(folder)
