"""Run by test_tensor_parallel_lifecycle.py: a TP = 2 engine that prints its pids (rank 0, then
the worker), waits for a line on stdin, then generates. Exits non-zero if generation fails."""

import os
import sys

from pagedkern.engine import LLM, SamplingParams

llm = LLM("synthetic:tiny", tensor_parallel_size=2, num_blocks=32)
workers = [p.pid for p in llm.engine.model.tp.procs.values()]
print("pids", os.getpid(), *workers, flush=True)
sys.stdin.readline()
out = llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=4), use_tqdm=False)
print("done", [g.token_ids for g in out], flush=True)
