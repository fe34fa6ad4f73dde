"""Ring attention at cp 2 against the unsharded attention, CPU time, errors and host syncs.

    python -m benchmarks.ring_kernels [--seq 1024] [--heads 8] [--kv-heads 2] [--dim 64]
                                      [--repeats 7] [--dtypes float32 bfloat16]
    python -m benchmarks.ring_kernels --device cuda --seq 16384 --heads 32 --kv-heads 8 \
                                      --dim 128 --dtypes bfloat16

One causal GQA attention (batch 1), forward and backward:

- ``sdpa``: the unsharded ``F.scaled_dot_product_attention(q, k, v, is_causal=True,
  enable_gqa=True)`` on the whole sequence;
- ``ring``: ``autotp.runtime.ring.ring_attention`` at cp 2 on the balanced layout (rank r
  holds chunks r and 3 - r of 4), the two ranks simulated as threads of this process
  (``ThreadComm``), each rank's CPU time (``time.thread_time``) summed over the ranks.

Every run uses one intra-op thread, so that a thread's CPU time is all the work it asks
for. The two run round robin (``benchmarks.harness``) ``--repeats`` times after one untimed
repetition; the figures are the medians of their times and of the ratio ``ring / sdpa`` of
each repetition. With ``--device cuda`` both ranks share the one device and a time is
wall-clock seconds up to a device synchronisation: the ring's is both ranks' work, as the
CPU's sum is. ``err out`` and ``err grad`` are the largest absolute
differences of the ring's output and q, k, v gradients (gathered into the global order) from
the unsharded SDPA's in the same dtype; ``sdpa err`` is SDPA's own largest difference in
that dtype from the float64 attention, for scale (left out above 4096 tokens on a device,
where the float64 attention's scores alone take tens of GiB). ``syncs/rank`` counts, per rank and
training step, the ops that read a tensor's value on the host (``aten.equal``,
``aten._local_scalar_dense``, ``aten.is_nonzero``) while the ring runs.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from autotp.runtime.comm import ThreadComm, ThreadHub
from benchmarks.harness import Column, Timing, header, line, ratio, round_robin
from autotp.runtime.ring import SequenceLayout, ring_attention

aten = torch.ops.aten
SYNCS = (aten.equal.default, aten._local_scalar_dense.default, aten.is_nonzero.default)


class HostSyncs(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (a device sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.count += func in SYNCS
        return func(*args, **(kwargs or {}))


def inputs(args: argparse.Namespace, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape_q = (1, args.heads, args.seq, args.dim)
    shape_kv = (1, args.kv_heads, args.seq, args.dim)
    device = getattr(args, "device", "cpu")
    return [torch.randn(s, generator=gen).to(device, dtype)
            for s in (shape_q, shape_kv, shape_kv, shape_q)]


def _on_device(t: torch.Tensor) -> bool:
    return t.device.type != "cpu"


def _clock(device: bool) -> float:
    """CPU seconds of this thread; on a device, wall seconds after its work has finished."""
    if device:
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.thread_time()


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         grad: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    start = _clock(_on_device(q))
    out = F.scaled_dot_product_attention(*xs, is_causal=True, enable_gqa=True)
    out.backward(grad)
    return _clock(_on_device(q)) - start, [out.detach(), *(x.grad for x in xs)]


def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
         count: bool = False) -> tuple[float, list[torch.Tensor], list[int]]:
    """(CPU seconds summed over the 2 ranks, or on a device the wall seconds of both, out
    and grads in the global order, host syncs per rank)."""
    layout = SequenceLayout(2, balanced=True)
    hub = ThreadHub(2, timeout=600)
    results: list[Any] = [None, None]
    device = _on_device(q)

    def rank(r: int) -> None:
        torch.set_num_threads(1)
        comm = ThreadComm(hub, r)
        xs = [layout.shard(t, 2, r).clone().requires_grad_() for t in (q, k, v)]
        g = layout.shard(grad, 2, r)
        mode = HostSyncs()
        start = time.thread_time()
        # a device's backward runs on one autograd thread shared by both ranks: a rank
        # waiting there for the other's message would hold up the other's backward
        with torch.autograd.set_multithreading_enabled(False):
            if count:
                with mode:
                    out = ring_attention(*xs, comm, layout, causal=True)
                    out.backward(g)
            else:
                out = ring_attention(*xs, comm, layout, causal=True)
                out.backward(g)
        results[r] = (time.thread_time() - start, [out.detach(), *(x.grad for x in xs)],
                      mode.count)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    start = _clock(device)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = _clock(device) - start
    if any(r is None for r in results):
        raise RuntimeError("a ring rank failed (its traceback is printed above)")
    parts = [results[r][1] for r in range(2)]
    whole = [layout.unshard([p[i] for p in parts], 2) for i in range(4)]
    seconds = wall if device else sum(r[0] for r in results)
    return seconds, whole, [r[2] for r in results]


def timed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
          repeats: int) -> tuple[Timing, Timing]:
    """SDPA's and the ring's CPU seconds, round robin (``benchmarks.harness``), after one
    untimed repetition of each."""
    runs = {"sdpa": lambda: sdpa(q, k, v, grad)[0], "ring": lambda: ring(q, k, v, grad)[0]}
    round_robin(list(runs), lambda name: runs[name](), repeats=1)
    times = round_robin(list(runs), lambda name: runs[name](), repeats=repeats)
    return Timing(tuple(times["sdpa"])), Timing(tuple(times["ring"]))


COLUMNS = [Column("dtype", 9, "dtype"), Column("sdpa ms", 8, "sdpa_ms", ".1f"),
           Column("ring ms", 8, "ring_ms", ".1f"), Column("ring/sdpa", 9, "ratio", ".2f"),
           Column("err out", 9, "err_out", ".2e"), Column("err grad", 9, "err_grad", ".2e"),
           Column("sdpa err", 9, "sdpa_err", ".2e"), Column("syncs/rank", 10, "syncs")]


def measure(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One dtype's row."""
    q, k, v, grad = inputs(args, getattr(torch, name))
    base, mine = timed(q, k, v, grad, args.repeats)
    _, want = sdpa(q, k, v, grad)
    _, got, syncs = ring(q, k, v, grad, count=True)
    errs = [float((a.double() - b.double()).abs().max()) for a, b in zip(got, want)]
    sdpa_err = None
    if not _on_device(q) or args.seq <= 4096:
        _, exact = sdpa(*(t.double() for t in (q, k, v, grad)))
        sdpa_err = max(float((a.double() - b).abs().max()) for a, b in zip(want, exact))
    return {"dtype": name, "sdpa_ms": 1e3 * base.median, "ring_ms": 1e3 * mine.median,
            "ratio": ratio(mine, base), "err_out": errs[0], "err_grad": max(errs[1:]),
            "sdpa_err": sdpa_err, "syncs": "/".join(map(str, syncs))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: both ranks on it")
    args = parser.parse_args()
    torch.set_num_threads(1)
    where = "1 intra-op thread" if args.device == "cpu" else f"both ranks on {args.device}"
    print(f"S={args.seq}, {args.heads} query / {args.kv_heads} key-value heads, head dim "
          f"{args.dim}, batch 1, causal, forward + backward, cp 2 (threads), {where}, "
          f"median of {args.repeats}")
    print(header(COLUMNS))
    for name in args.dtypes:
        print(line(COLUMNS, measure(args, name)))


if __name__ == "__main__":
    main()
