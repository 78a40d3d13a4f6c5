"""Peak resident memory of rank 0 and of a worker when an engine starts at tensor_parallel_size 2
on the CPU (gloo), for a random Llama-shaped HF folder of ~500 MB (fp32 safetensors) or, with
--format gguf, a Q8_0 GGUF of its layers (built once in a child process): the memory a rank
needs to load its part of the checkpoint.

    python bench/tp_shard_rss.py [--folder DIR] [--size 2] [--format hf|gguf]

Each engine starts in a fresh process (peak RSS is per process); rank 0's peak is its own
ru_maxrss, a worker's its VmHWM read from /proc while it runs. Also printed: the peak of a
process that only imports the package (the interpreter and torch), the file's size and each
rank's weight bytes. Compare two checkouts by running this with PYTHONPATH=<checkout>/python
(each line names the package it loaded).

    python bench/tp_shard_rss.py --model qwen3-moe [--format hf|gguf]

A Qwen3-MoE-shaped folder instead (transformers builds it; 431 MiB fp32, two thirds of it the
experts), each engine started twice: tensor parallelism (every expert's intermediate size split) and
--expert-parallel (each rank whole experts, half of them), one fresh process each."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Llama-shaped: 12 layers of hidden 768, 12 query / 4 KV heads, MLP 2048, vocabulary 32000
CONFIG = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=512,
)


# Qwen3-MoE-shaped: 6 layers of hidden 512, 8 query / 4 KV heads of 64, 32 experts of 256, top-8
MOE_CONFIG = dict(
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_experts=32,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=32000,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def build_moe(folder: Path, kind: str) -> None:
    import torch
    import transformers
    from hf_model_files import write_tokenizer

    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**MOE_CONFIG)).float()
    if kind == "gguf":  # Q8_0 experts and layers, as llama.cpp's converter writes them
        import gguf
        from test_model_moe_gguf import write_moe_gguf

        q8 = gguf.GGMLQuantizationType.Q8_0
        write_moe_gguf(folder / "model.gguf", hf, "qwen3moe", q8, dense_type=q8)
    else:
        hf.save_pretrained(folder, safe_serialization=True)
        write_tokenizer(folder)


def build(folder: Path, kind: str, model: str = "llama") -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_model_files import base_config, write_folder

    folder.mkdir(parents=True, exist_ok=True)
    if model == "qwen3-moe":
        build_moe(folder, kind)
    elif kind == "gguf":  # (the test tokenizer's vocabulary: the layers make the size)
        from test_model_gguf import write_gguf

        write_gguf(folder / "model.gguf", base_config(**CONFIG))
    else:
        write_folder(folder, base_config(**CONFIG))


def checkpoint(folder: Path, kind: str) -> Path:
    return folder / "model.gguf" if kind == "gguf" else folder


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (KiB on Linux)


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def measure(path: Path, size: int, expert_parallel: bool = False) -> dict:
    import tempfile

    os.environ["PAGEDKERN_CACHE_DIR"] = tempfile.mkdtemp()  # a GGUF converts on every run
    import pagedkern
    from pagedkern.engine import LLM

    settings = dict(device="cpu", quantization="none", num_blocks=16, block_size=16)
    settings["expert_parallel"] = expert_parallel
    with LLM(str(path), tensor_parallel_size=size, **settings) as llm:
        model = llm.engine.model
        workers = model.tp.procs
        out = {
            "package": os.path.dirname(pagedkern.__file__),
            "rank0_peak_mib": round(peak_mib()),
            "worker_peak_mib": [round(vm_hwm_mib(p.pid)) for p in workers.values()],
            "rank0_weights_mib": round(model.weights.nbytes / 2**20),
        }
    return out


def baseline() -> dict:
    import pagedkern.engine  # noqa: F401  (what every rank imports)

    return {"import_peak_mib": round(peak_mib())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/pagedkern-tp-rss-model"))
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--format", choices=["hf", "gguf"], default="hf")
    parser.add_argument("--model", choices=["llama", "qwen3-moe"], default="llama")
    parser.add_argument("--expert-parallel", action="store_true", help="(--phase measure)")
    parser.add_argument("--phase", choices=["build", "measure", "baseline"], default=None)
    args = parser.parse_args()
    if args.model == "qwen3-moe" and args.folder == parser.get_default("folder"):
        args.folder = Path(f"/tmp/pagedkern-ep-rss-{args.format}")
    path = checkpoint(args.folder, args.format)
    if args.phase == "build":
        build(args.folder, args.format, args.model)
        return 0
    if args.phase is not None:
        if args.phase == "baseline":
            result = baseline()
        else:
            result = measure(path, args.size, args.expert_parallel)
        print(json.dumps(result))
        return 0
    common = ["--folder", str(args.folder), "--format", args.format, "--model", args.model]
    if not (path / "config.json" if args.format == "hf" else path).is_file():
        subprocess.run([sys.executable, __file__, "--phase", "build", *common], check=True)
    files = [path] if args.format == "gguf" else list(args.folder.glob("*.safetensors"))
    file_mib = sum(f.stat().st_size for f in files) / 2**20
    print(f"checkpoint: {path} ({file_mib:.0f} MiB), tensor_parallel_size {args.size}")
    runs = [("baseline", [])]
    if args.model == "qwen3-moe":  # both splits of the experts
        runs += [("measure tp", []), ("measure ep", ["--expert-parallel"])]
    else:
        runs += [("measure", [])]
    for name, extra in runs:
        command = [sys.executable, __file__, "--phase", name.split()[0], *common, *extra]
        done = subprocess.run(command + ["--size", str(args.size)], check=True,
                              capture_output=True, text=True)  # fmt: skip
        print(name, done.stdout.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
