"""Process helpers that serving/ and parallel/ share, below both (they import nothing of
pagedkern): the cores this process may run on, a launcher's rank, dying with the parent."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def launched_by_launcher() -> bool:
    """Whether a launcher such as torchrun started this process (its variables are all set)."""
    return all(name in os.environ for name in LAUNCHER_ENV)


def launcher_rank() -> int:
    """This process's rank when a launcher (torchrun) started it, else 0."""
    return int(os.environ["RANK"]) if launched_by_launcher() else 0


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def die_with_parent(parent: int | None = None) -> None:
    """A child process: SIGKILL when the parent exits (Linux prctl: fires when the thread that
    spawned it exits, so a parent spawns from its main thread), and a watch on the parent pid
    for where prctl is unavailable."""
    parent = os.getppid() if parent is None else parent
    with contextlib.suppress(Exception):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # already gone before prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            threading.Event().wait(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
