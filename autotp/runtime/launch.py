"""Run a function on N local processes joined by a gloo (or NCCL) process group.

Workers start from a fork server that has imported torch and autotp once (and transformers,
when the caller has): a worker costs a fork rather than a fresh interpreter's imports, which
on a small machine take longer than a small model's whole run. Each worker takes the
caller's environment and ``sys.path`` as they are at the launch, as a spawned one would.

Results travel back over a queue before any teardown, and workers end with ``os._exit``:
gloo workers can abort during interpreter shutdown after the group is destroyed, which must
not turn a finished run into a failure.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# imported once by the fork server; what the workers import anyway
_PRELOAD = ["torch", "torch.distributed", "autotp.api"]
# only when the caller has imported transformers: its models' base (1 to 1.5 s a worker)
_OPTIONAL_PRELOAD = ["transformers", "transformers.modeling_utils"]


def _context() -> Any:
    if "forkserver" not in mp.get_all_start_methods():  # Windows
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    optional = _OPTIONAL_PRELOAD if "transformers" in sys.modules else []
    ctx.set_forkserver_preload(_PRELOAD + optional)
    return ctx


def _worker(rank: int, world_size: int, port: int, backend: str, fn: Callable[..., Any],
            args: tuple, results: Any, timeout: float, environ: dict[str, str]) -> None:
    code = 0
    try:
        os.environ.clear()  # the fork server's environment is the one of its first launch
        os.environ.update(environ)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        threads = os.environ["OMP_NUM_THREADS"]
        if threads.isdigit() and int(threads) > 0:  # torch read it when the server imported it
            torch.set_num_threads(int(threads))
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
        code = 1
    results.close()
    results.join_thread()  # the result must be on the pipe before the hard exit
    os._exit(code)


def run_processes(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                  timeout: float = 300.0, allow_failures: bool = False) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` processes; results in rank order.

    ``fn`` must be importable by a fresh interpreter (a module-level function). With
    ``allow_failures`` every rank's outcome is returned as ``(ok, value_or_traceback)``
    instead of raising on the first failure.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_worker,
                         args=(r, world_size, port, backend, fn, args, results, timeout,
                               environ),
                         daemon=True)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    got: dict[int, Any] = {}
    failure: Optional[str] = None
    try:
        while len(got) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                failure = f"no result from ranks {sorted(set(range(world_size)) - set(got))} " \
                          f"within {timeout:.0f} s"
                break
            if not ok and not allow_failures:
                failure = f"rank {rank} failed:\n{value}"
                break
            got[rank] = (ok, value) if allow_failures else value
    finally:
        for proc in procs:
            proc.join(timeout=10 if failure is None else 1)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    if failure is not None:
        raise RuntimeError(failure)
    return [got[r] for r in range(world_size)]
