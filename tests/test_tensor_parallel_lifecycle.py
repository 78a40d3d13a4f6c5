"""TP processes never outlive rank 0, and a dead worker ends rank 0 with an error naming it.
Process exits are awaited by polling /proc with a bounded deadline (no timing sleeps)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("tensor_parallel_child.py")
DEADLINE_S = 60.0


def gone(pid: int) -> bool:
    """No such process, or a zombie (exited; waiting for whoever reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_gone(pids: list[int], deadline: float = DEADLINE_S) -> bool:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.05)  # a poll interval, not a wait for something to have happened
    return all(gone(p) for p in pids)


def start_child() -> tuple[subprocess.Popen, int, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, str(CHILD)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    line = proc.stdout.readline()
    assert line.startswith("pids "), line + proc.stderr.read()
    rank0, *workers = (int(x) for x in line.split()[1:])
    assert rank0 == proc.pid and len(workers) == 1
    return proc, rank0, workers


def test_killing_rank0_leaves_no_worker():
    proc, _, workers = start_child()
    try:
        assert not any(gone(p) for p in workers)
        proc.kill()
        proc.wait(DEADLINE_S)
        assert wait_gone(workers), f"orphan workers {workers}"
    finally:
        for pid in workers:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_killing_a_worker_fails_rank0_naming_the_rank():
    proc, _, workers = start_child()
    try:
        os.kill(workers[0], signal.SIGKILL)
        assert wait_gone(workers)
        out, err = proc.communicate("go\n", timeout=DEADLINE_S)
        assert proc.returncode != 0, out + err
        assert "done" not in out
        assert "TensorParallelError" in err, err
        assert f"worker rank 1 (pid {workers[0]}) exited with signal 9" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # three interpreter starts and torchrun's own; the group itself: the tests above
def test_torchrun_ranks_join_one_group_and_answer_as_tp1():
    """The multi-host path on one host: torchrun starts both ranks of the same command; rank 1
    becomes a worker, rank 0 answers exactly what TP = 1 answers."""
    torchrun = Path(sys.executable).with_name("torchrun")
    args = ["--model", "synthetic:tiny", "--num-blocks", "32", "--max-tokens", "6", "hello"]
    cli = ["-m", "pagedkern.serving.cli", *args]
    want = subprocess.run([sys.executable, *cli], capture_output=True, timeout=DEADLINE_S)
    launch = [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2"]
    launch += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    got = subprocess.run(
        [*launch, *cli, "--tensor-parallel-size", "2"], capture_output=True, timeout=DEADLINE_S
    )
    assert want.returncode == 0 and got.returncode == 0, got.stderr.decode()
    assert got.stdout == want.stdout and len(want.stdout) > 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
