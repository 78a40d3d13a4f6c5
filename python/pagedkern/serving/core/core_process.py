"""The engine core as a process of its own (`pagedkern-serve --http`), both ends: the front
end's `spawn_core` starts it (multiprocessing's spawn) and waits for its Ready, or for why it
could not load; the spawn target `core_process` loads the engine, hands the front end its
tokenizer and Ready, and runs EngineCore's loop on its main thread; `core_threads` picks its
torch intra-op threads so the front end keeps a core where it needs one.

The process ignores Ctrl-C (the front end's to handle), dies with its parent
(PR_SET_PDEATHSIG), and its TP workers with it; it ends with os._exit once the engine is closed.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import NamedTuple

import torch

from ...engine import Engine, EngineConfig
from ...model.tokenizer import Tokenizer
from ...processes import available_cores
from .channel import Channel
from .engine_core import EngineCore, core_info
from .messages import CoreInfo, Failed, Ready

log = logging.getLogger("pagedkern.serving")
STARTUP_TIMEOUT_S = 600.0  # loading a big model from a cold disk


class EngineStartError(RuntimeError):
    """The engine core could not load (the message says why, e.g. an unknown model)."""


class SpawnedCore(NamedTuple):
    """A started core process as its client holds it: `join(timeout)` waits for its end (and
    kills it past the timeout; an abnormal exit is logged once)."""

    channel: Channel
    info: CoreInfo
    tokenizer: Tokenizer
    join: Callable[[float], None]


def spawn_core(
    config: EngineConfig,
    max_queue: int | None = None,
    *,
    trace: bool = False,
    log_level: str = "WARNING",
    core_threads: int | None = None,  # None: core_threads() decides, in the core
) -> SpawnedCore:
    """Start the engine core process and wait until it has loaded the model. Raises
    EngineStartError with the core's message when loading fails."""
    context = multiprocessing.get_context("spawn")
    front, back = context.Pipe()
    folder = tempfile.mkdtemp(prefix="pagedkern-tokenizer-")
    process = context.Process(
        target=core_process,
        args=(config, back, folder, max_queue, trace, log_level, core_threads),
        name="pagedkern-engine-core",
    )
    process.start()
    back.close()  # the child holds it now: its exit is our EOF
    channel = Channel(front)
    try:
        if not channel.poll(STARTUP_TIMEOUT_S):
            raise EngineStartError(f"the engine core did not start in {STARTUP_TIMEOUT_S:g} s")
        try:
            ready = channel.recv()
        except EOFError:
            process.join(5)
            message = f"the engine core exited while loading (exit code {process.exitcode})"
            raise EngineStartError(message) from None
        if isinstance(ready, Failed):
            raise EngineStartError(ready.message)
        tokenizer = Tokenizer.from_folder(folder)
    except BaseException:
        process.kill()
        process.join()
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    reported = []

    def join(timeout: float) -> None:
        process.join(timeout)
        if process.exitcode is None:
            log.error("the engine core did not stop in %g s: killing it", timeout)
            process.kill()
            process.join()
        elif process.exitcode != 0 and not reported:  # (join runs twice at shutdown)
            reported.append(process.exitcode)
            code = process.exitcode
            how = f"signal {-code}" if code < 0 else f"status {code}"
            log.error("the engine core exited with %s", how)

    return SpawnedCore(channel, ready.info, tokenizer, join)


# What core_threads weighs, measured on the 2-core CI machine: the front end's CPU per delivered
# token (bench/test_bench_http_frontend.py: 20-26 µs) and one core's fp32 GEMM rate (~68
# GFLOP/s for [16, 576] @ [576, 3072]; 50 to leave the forward's other work a margin).
FRONT_END_S_PER_TOKEN = 25e-6
CORE_FLOPS_PER_S = 50e9


def core_threads(engine: Engine, requested: int | None = None) -> int | None:
    """The engine core's torch intra-op threads, or None to leave them alone (a CUDA engine,
    whose forward does not run on them; TP ranks, which split the cores among themselves).

    The front end shares the machine's cores with the core's threads, and an OpenMP team whose
    worker thread the front end preempts stalls every parallel region on it (measured here at
    256 streams of synthetic:tiny: 2 threads made the core 1.2-2x costlier per token than 1).
    So when the front end's share of the CPU per token, f / (e + f), is at least one core's
    share, 1 / cores, it gets a core of its own: e <= f * (cores - 1), e estimated as the
    forward's 2 * parameters FLOPs on one core. synthetic:tiny (150 k parameters, e ~ 6 µs)
    leaves a core to the front end; SmolLM2-135M (e ~ 5 ms) keeps both, as offline."""
    if requested is not None:
        return requested
    if engine.model.device.type != "cpu" or engine.model.tp.size > 1:
        return None
    cores = available_cores()
    model_s_per_token = 2 * engine.model.config.num_parameters(active=True) / CORE_FLOPS_PER_S
    if cores > 1 and model_s_per_token <= FRONT_END_S_PER_TOKEN * (cores - 1):
        return cores - 1
    return cores


def freeze_startup_objects() -> None:
    """Move every object alive now (modules, the model, tokenizer, app) out of the garbage
    collector's reach, as vLLM's processes do once started: a full collection otherwise
    rescans them all, ~2 ms each at 1024 requests in flight (bench/test_bench_host_overhead.py),
    landing in whichever step or token triggers it. Only in the server's own processes: a
    test process would keep its garbage of the moment forever."""
    gc.collect()
    gc.freeze()


def core_process(
    config: EngineConfig,
    conn: Connection,
    tokenizer_dir: str,
    max_queue: int | None = None,
    trace: bool = False,
    log_level: str = "WARNING",
    threads: int | None = None,  # None: core_threads decides
) -> None:
    """The engine core process (multiprocessing spawn target): load the engine, hand the
    front end its tokenizer (saved into tokenizer_dir) and Ready, serve until told to stop."""
    from ...processes import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's to handle
    die_with_parent()
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    channel = Channel(conn)
    try:
        engine = Engine.from_config(config)
        engine.tokenizer.save(tokenizer_dir)
    except Exception as exc:  # noqa: BLE001 - unknown model, no GPU for --backend cuda, ...
        channel.send(Failed(str(exc)))
        return
    engine.model.tp.exit_on_failure = True  # a dead TP rank ends the core, then the server
    if trace:
        from .trace import TraceWriter

        engine.tracer = TraceWriter(engine.tokenizer)
    threads = core_threads(engine, threads)
    if threads is not None:
        torch.set_num_threads(threads)
    core = EngineCore(engine, channel, max_queue)
    freeze_startup_objects()
    channel.send(Ready(core_info(engine, core.max_queue)))
    # The loop runs on the main thread, which loaded the model, so the steps use the OpenMP
    # team that did. A loop on another thread gets a second team, and its parallel regions
    # ran slower (likely: libgomp stops spinning between regions once it manages more threads
    # than cores): SmolLM2-135M over HTTP served 139 tok/s with the loop on a thread, 205 on
    # the main thread (the offline engine: 203). The main thread also spawned the TP workers
    # (their PR_SET_PDEATHSIG follows it) and lives as long as the loop.
    try:
        core.run()
    finally:
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - still exit deliberately
            log.exception("closing the engine failed")
            core.failed = True
    exit_now(1 if core.failed else 0)


def exit_now(status: int) -> None:
    """End the core process here, once the engine is closed (TP workers stopped, the step
    thread joined): flush the logs and std streams, then os._exit. The interpreter's own
    shutdown would run with daemon threads still alive (the channel's reader, blocked in recv;
    the parent-pid watch) and C++ static destructors after it, and sometimes ended in SIGABRT
    ("terminate called without an active exception") after every stream had ended cleanly."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
