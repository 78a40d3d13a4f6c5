"""The tensor-parallel process group: start or join it, the per-step broadcast, lifecycle.

Rank 0 is the engine core (the process the user started); ranks 1..N-1 are workers it spawns
(`python -m pagedkern.parallel.worker`, MASTER_ADDR=127.0.0.1 and a free port), or processes a
launcher such as torchrun started (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK set),
which join the same way. gloo on the CPU, NCCL on CUDA.

Per step rank 0 broadcasts a fixed-size int64 header, then the step's packed int32 buffer
(BatchLayout.pack): no Python objects on the hot path. Startup broadcasts the engine settings
once (a pickled dict) and, once the KV cache is sized, its block count.

Failure: a worker that exits while rank 0 runs is noticed by a thread waiting on it; rank 0's
next (or current) step raises TensorParallelError naming the rank, the engine fails every open
request with it, and the process exits non-zero (the group cannot be repaired). Workers die with
rank 0: PR_SET_PDEATHSIG plus a parent-pid watch, and a broken collective ends their loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta

import torch

from ..model.attention_metadata import AttentionMetadata, BatchLayout, unpack_batch
from ..processes import available_cores, launched_by_launcher
from .context import TPContext

log = logging.getLogger("pagedkern.parallel")

STARTUP_TIMEOUT_S = 120  # process-group rendezvous, model loading on every rank
HEADER = 10  # int64s: kind, T, B, width, logits rows, prefills, prefill tokens, max q, max seq, lm
STOP, STEP, SEND_KV = 0, 1, 2  # header kinds; SEND_KV: gather every rank's KV cache (tests)


class TensorParallelError(RuntimeError):
    """The tensor-parallel group broke (a rank exited or a collective failed): fatal."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_cpu_threads(size: int) -> None:
    """N processes on one host share its cores."""
    torch.set_num_threads(max(1, available_cores() // size))


class TPGroup(TPContext):
    """One rank's membership. Rank 0 also owns the spawned workers and watches them."""

    def __init__(self, rank: int, size: int, device: torch.device):
        TPContext.__init__(self, rank, size)
        self.device = device
        self.procs: dict[int, subprocess.Popen] = {}
        self.failure: str | None = None
        self.closing = False
        self._header = torch.zeros(HEADER, dtype=torch.int64)
        self._threads: int | None = None

    # --- start -------------------------------------------------------------------------------
    @classmethod
    def start(cls, size: int, device: torch.device) -> TPGroup:
        """Join the launcher's group (RANK etc. set) or spawn size-1 local workers."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        if launched_by_launcher():
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            if world != size:
                raise ValueError(f"tensor_parallel_size {size} but WORLD_SIZE={world}")
            group = cls(rank, size, _rank_device(device, int(os.environ["LOCAL_RANK"])))
            init = "env://"
        else:
            group = cls(0, size, device)
            port = _free_port()
            init = f"tcp://127.0.0.1:{port}"
            group._spawn(port, device)
        if group.device.type == "cpu":
            group._threads = torch.get_num_threads()  # given back by close()
            split_cpu_threads(size)
        else:
            torch.cuda.set_device(group.device)
        try:
            import torch.distributed as dist

            dist.init_process_group(
                backend,
                init_method=init,
                rank=group.rank,
                world_size=size,
                timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
            )
        except Exception as exc:
            group.close()
            raise TensorParallelError(
                f"tensor-parallel group of {size} did not start: {group.failure or exc}"
            ) from exc
        return group

    def _spawn(self, port: int, device: torch.device) -> None:
        for rank in range(1, self.size):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(self.size),
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            # CUDA_VISIBLE_DEVICES-aware: rank r uses visible device r (LOCAL_RANK).
            command = [sys.executable, "-m", "pagedkern.parallel.worker"]
            command += ["--device", device.type, "--parent-pid", str(os.getpid())]
            proc = subprocess.Popen(command, env=env, close_fds=True)
            self.procs[rank] = proc
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"tp-watch-{rank}", daemon=True
            ).start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        proc.wait()
        if not self.closing:
            self._exited(rank, proc)

    def _exited(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.returncode
        how = f"signal {-code}" if code < 0 else f"status {code}"
        self.fail(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with {how}")

    def fail(self, message: str) -> None:
        """Record the group's (first) failure; the server exits after a bounded moment in
        which the engine answers its open requests with the error."""
        if self.failure is not None:
            return
        self.failure = message
        log.error("%s", message)
        if self.exit_on_failure:
            threading.Timer(5.0, self._exit).start()

    def _exit(self) -> None:
        log.error("exiting: %s", self.failure)
        self.close()
        os._exit(1)

    # --- startup exchanges ---------------------------------------------------------------------
    def share_settings(self, settings: dict | None) -> dict:
        """Rank 0's engine settings to every rank (once, at startup: a pickled dict is fine)."""
        import torch.distributed as dist

        box = [settings]
        with self.fatal_errors():  # e.g. a worker that failed to start: named
            dist.broadcast_object_list(box, src=0, device=self._comm_device())
        return box[0]

    def share_cache_shape(self, num_blocks: int = 0, block_size: int = 0) -> tuple[int, int]:
        """Rank 0's KV cache shape to every rank (each allocates its heads of the same blocks);
        rank 0 waits here for the workers to have loaded the model."""
        shape = torch.tensor([num_blocks, block_size], dtype=torch.int64)
        with self.fatal_errors():
            self._broadcast(shape)
        return int(shape[0]), int(shape[1])

    # --- per step --------------------------------------------------------------------------------
    def upload(
        self, layout: BatchLayout, device: torch.device, logits: bool
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Rank 0: send the step to the workers; input_ids and metadata on `device`."""
        return self.broadcast_step(layout, device, logits)

    def broadcast_step(
        self, layout: BatchLayout, device: torch.device, logits: bool
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Rank 0: send the step to the workers; input_ids and metadata on `device`."""
        self.check()
        b = len(layout.seq_lens)
        header = self._header
        header.copy_(
            torch.tensor(
                [
                    STEP,
                    len(layout.input_ids),
                    b,
                    layout.width,
                    len(layout.logits_indices),
                    layout.num_prefills,
                    layout.cu_seqlens[layout.num_prefills],
                    layout.max_query_len,
                    max(layout.seq_lens),
                    int(logits),
                ]
            )
        )
        flat = layout.pack().to(self._comm_device())
        with self.fatal_errors():
            self._broadcast(header)
            self._broadcast(flat)
        return layout.unpack(flat.to(device))

    def receive_header(self) -> list[int]:
        """A worker: the next header (kind first: STOP, STEP or SEND_KV)."""
        self._broadcast(self._header)
        return self._header.tolist()

    def receive_batch(self, header: list[int]) -> tuple[torch.Tensor, AttentionMetadata, bool]:
        """A worker: a STEP's batch (input_ids, metadata, compute logits?) on its device."""
        _, t, b, width, n, prefills, prefill_tokens, max_q, max_seq, lm = header
        sizes = [t, t, t, b + 1, b * width, b, n]
        flat = torch.empty(sum(sizes), dtype=torch.int32, device=self._comm_device())
        self._broadcast(flat)
        ids, meta = unpack_batch(
            flat.to(self.device), sizes, b, width, prefills, prefill_tokens, max_q, max_seq
        )
        return ids, meta, bool(lm)

    def gather_kv_caches(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Rank 0: every rank's whole KV cache tensor, by rank (for checks, not the hot path)."""
        import torch.distributed as dist

        self.check()
        self._header.zero_()
        self._header[0] = SEND_KV
        with self.fatal_errors():
            self._broadcast(self._header)
            parts = [torch.empty_like(local) for _ in range(self.size)]
            dist.gather(local.contiguous(), parts, dst=0)
        return parts

    def send_kv_cache(self, local: torch.Tensor) -> None:
        """A worker's side of gather_kv_caches."""
        import torch.distributed as dist

        dist.gather(local.contiguous(), None, dst=0)

    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    @contextlib.contextmanager
    def fatal_errors(self) -> Iterator[None]:
        """Rank 0: any error between a step's broadcast and the end of its forward leaves the
        ranks out of step (a collective one of them never joins): the group is done."""
        try:
            yield
        except TensorParallelError:
            raise
        except Exception as exc:
            self._find_failed_rank()
            self.fail(f"tensor-parallel step failed on rank {self.rank}: {exc!r}")
            raise TensorParallelError(self.failure) from exc

    def _find_failed_rank(self, timeout: float = 5.0) -> None:
        """A broken collective usually means a worker died: wait (bounded) for its watcher."""
        for rank, proc in self.procs.items():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout / max(1, len(self.procs)))
            if proc.returncode is not None:
                self._exited(rank, proc)
                return

    # --- end -------------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Rank 0: tell the workers to stop, wait for them (bounded), kill stragglers."""
        if self.closing:
            return
        self.closing = True
        import torch.distributed as dist

        if self.rank == 0 and self.failure is None and dist.is_initialized():
            with contextlib.suppress(Exception):
                self._header.zero_()  # kind STOP
                self._broadcast(self._header)
        for proc in self.procs.values():
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        if self._threads is not None:
            torch.set_num_threads(self._threads)

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _broadcast(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        if t.device != self._comm_device():
            moved = t.to(self._comm_device())
            dist.broadcast(moved, src=0)
            t.copy_(moved)
        else:
            dist.broadcast(t, src=0)


def _rank_device(device: torch.device, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device.type == "cuda" else device
