"""What a GPU and its interconnect can do: the numbers the time and memory model runs on.

A ``Hardware`` is one accelerator kind and the cluster around it: peak dense FLOP/s per
dtype, memory capacity and bandwidth, the bandwidth and latency of collectives within a node
and across nodes, and how close real kernels get to those peaks. Named presets cover the
common machines; anything else is a JSON or TOML file with the same fields
(``autotp estimate --hardware my.json``), which ``autotp estimate --calibrate`` writes from
measurements on the GPU at hand.

The achieved fractions are what large, well-shaped kernels reach in practice, not marketing
peaks: a GEMM of ``flops`` FLOPs takes ``(flops + gemm_knee) / (peak * gemm_efficiency)``
seconds, so small GEMMs (a tensor-parallel slice of a small model) run far below peak and big
ones approach ``gemm_efficiency`` of it, and never less than moving its operands and result
(a product of a short contraction, attention's scores with a head dimension of 64 or 128, is
bound by memory, not by the tensor cores). Memory-bound kernels move their bytes at
``memory_efficiency`` of the HBM bandwidth after a fixed ``kernel_overhead``; no kernel is
shorter than the ``host_overhead`` of launching it from eager PyTorch.

A collective costs a fixed launch latency plus one ``*_step_latency`` per step of its ring
(``2 (p - 1)`` for an all-reduce of ``p`` ranks, ``p - 1`` for an all-gather or
reduce-scatter) plus its bytes over the achieved bus bandwidth: its latency grows with the
group.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autotp.errors import ConfigError
from autotp.planner.job.memory import Precision

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: dict[str, float]  # peak dense FLOP/s per dtype name ("bfloat16", "float16", ...)
    memory: float  # bytes of device memory per GPU
    memory_bandwidth: float  # bytes/s of device memory
    intra_node_bandwidth: float  # bytes/s one GPU sends to its node's peers (one direction)
    inter_node_bandwidth: float  # bytes/s one GPU sends across nodes (its share of the NICs)
    gpus_per_node: int = 8
    # s a collective costs before its ring starts (launch, setup): NCCL's base latency of
    # its Ring/Simple algorithm (src/graph/tuning.cc: 8.4 us)
    intra_node_latency: float = 8.4e-6
    inter_node_latency: float = 25e-6  # s, the same across nodes
    # s per step of a ring (each rank waits for its neighbour's chunk): NCCL's hardware
    # latency of Ring/Simple per step (tuning.cc: 3.4 us over NVLink since NCCL 2.7, 14 us
    # over the network since 2.18); --calibrate measures it from all-reduces
    intra_node_step_latency: float = 3.4e-6
    inter_node_step_latency: float = 14e-6
    gemm_efficiency: float = 0.75  # fraction of peak the largest GEMMs reach
    gemm_knee: float = 2e9  # FLOPs: a GEMM this size runs at half of gemm_efficiency
    memory_efficiency: float = 0.8  # fraction of memory bandwidth elementwise kernels reach
    # fraction of peak a fused attention kernel (FlashAttention, PyTorch's SDPA) reaches on
    # its FLOPs: below a GEMM's (the softmax between its two products); --calibrate times a
    # causal SDPA. 0.45: measured on an H200 (bfloat16, 16 heads of 128, s 4096)
    attention_efficiency: float = 0.45
    # fraction of memory bandwidth one fused optimizer step and the zeroing of the gradients
    # reach (many tensors, several reads and writes each); --calibrate times torch's fused
    # AdamW. 0.35: measured on an H200 (bfloat16 AdamW over 0.2 to 1.1 B parameters)
    optimizer_efficiency: float = 0.35
    # s per kernel on the GPU (launch, ramp-up, tail); --calibrate times a CUDA graph of
    # back-to-back one-element kernels
    kernel_overhead: float = 5e-6
    # s of host time eager PyTorch spends dispatching one op (Python, autograd, launch): a
    # kernel shorter than this leaves the GPU waiting for the next one; --calibrate times a
    # loop of eager one-element ops
    host_overhead: float = 10e-6
    collective_efficiency: float = 0.8  # achieved bus bandwidth over the link's
    memory_reserved: float = 0.05  # fraction of memory the framework and allocator keep
    source: str = ""

    def peak(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise ConfigError(f"hardware {self.name!r} gives no peak FLOP/s for {dtype}; it "
                              f"has {', '.join(sorted(self.flops))}")
        return self.flops[dtype]

    @property
    def usable_memory(self) -> float:
        return self.memory * (1 - self.memory_reserved)

    def gemm_time(self, flops: float, dtype: str, nbytes: float = 0.0) -> float:
        """A product's time: its FLOPs at the efficiency its size allows, or moving its
        ``nbytes`` of operands and result, whichever is longer (the roofline)."""
        if flops <= 0:
            return 0.0
        return max(self.host_overhead,
                   (flops + self.gemm_knee) / (self.peak(dtype) * self.gemm_efficiency),
                   self.memory_time(nbytes) if nbytes > 0 else 0.0)

    def attention_time(self, flops: float, dtype: str, nbytes: float = 0.0) -> float:
        """A fused attention's time: its FLOPs at ``attention_efficiency``, or its bytes."""
        if flops <= 0:
            return 0.0
        return max(self.host_overhead, self.kernel_overhead +
                   flops / (self.peak(dtype) * self.attention_efficiency),
                   self.memory_time(nbytes) if nbytes > 0 else 0.0)

    def optimizer_time(self, nbytes: float) -> float:
        """One fused optimizer step (and zeroing the gradients) moving ``nbytes``."""
        return self.kernel_overhead + nbytes / (self.memory_bandwidth *
                                                self.optimizer_efficiency)

    def memory_time(self, nbytes: float) -> float:
        return max(self.host_overhead, self.kernel_overhead +
                   nbytes / (self.memory_bandwidth * self.memory_efficiency))

    def link(self, within_node: bool) -> tuple[float, float]:
        """(launch latency s, achieved bus bandwidth bytes/s) of a collective group."""
        if within_node:
            return self.intra_node_latency, self.intra_node_bandwidth * self.collective_efficiency
        return self.inter_node_latency, self.inter_node_bandwidth * self.collective_efficiency

    def ring_latency(self, steps: int, within_node: bool) -> float:
        """s before the first byte of a ring of ``steps`` steps is through: launch plus one
        hop latency per step."""
        launch, _ = self.link(within_node)
        step = self.intra_node_step_latency if within_node else self.inter_node_step_latency
        return launch + max(0, steps) * step

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Sources: vendor data sheets (peak dense tensor-core FLOP/s without sparsity, memory size and
# bandwidth, NVLink/NVSwitch bandwidth per GPU, NICs per node); the achieved fractions are
# typical of cuBLAS GEMMs and NCCL bus bandwidth on these systems as published by their
# vendors' benchmark reports (nccl-tests, MLPerf training submissions).
PRESETS: dict[str, Hardware] = {
    # DGX-2H: 16 V100-SXM3 32 GB at 450 W, NVSwitch (6 NVLink2 links: 150 GB/s per direction
    # per GPU), 8 x 100 Gb/s InfiniBand EDR for 16 GPUs. The setting of Megatron-LM (2019).
    "v100": Hardware(
        name="v100", flops={"float16": 130 * TFLOPS, "float32": 16.4 * TFLOPS},
        memory=32 * 2**30, memory_bandwidth=900 * GB, intra_node_bandwidth=150 * GB,
        inter_node_bandwidth=6.25 * GB, gpus_per_node=16, gemm_efficiency=0.72,
        gemm_knee=1.5e9, kernel_overhead=8e-6, inter_node_latency=30e-6,
        # the NCCL of its time (2.5, late 2019; tuning.cc): Ring/Simple 5.7 us per step over
        # NVLink, 6.6 us over the network
        intra_node_step_latency=5.7e-6, inter_node_step_latency=6.6e-6,
        source="NVIDIA DGX-2H data sheet; Tesla V100 data sheet (SXM3 450 W); NCCL 2.5 "
               "tuning.cc (ring latencies)"),
    # DGX A100: 8 A100-SXM4, NVLink3 via NVSwitch (300 GB/s per direction per GPU),
    # 8 x 200 Gb/s HDR InfiniBand (25 GB/s per GPU).
    "a100-40gb": Hardware(
        name="a100-40gb", flops={"bfloat16": 312 * TFLOPS, "float16": 312 * TFLOPS,
                                 "tfloat32": 156 * TFLOPS, "float32": 19.5 * TFLOPS},
        memory=40 * 2**30, memory_bandwidth=1555 * GB, intra_node_bandwidth=300 * GB,
        inter_node_bandwidth=25 * GB, gemm_efficiency=0.8, gemm_knee=3e9,
        source="NVIDIA A100 Tensor Core GPU data sheet (SXM4 40 GB); DGX A100 data sheet"),
    # DGX H100: 8 H100-SXM5, NVLink4 via NVSwitch (450 GB/s per direction per GPU),
    # 8 x 400 Gb/s NDR InfiniBand (50 GB/s per GPU).
    "h100": Hardware(
        name="h100", flops={"bfloat16": 989 * TFLOPS, "float16": 989 * TFLOPS,
                            "tfloat32": 494 * TFLOPS, "float32": 67 * TFLOPS},
        memory=80 * 2**30, memory_bandwidth=3350 * GB, intra_node_bandwidth=450 * GB,
        inter_node_bandwidth=50 * GB, gemm_efficiency=0.7, gemm_knee=8e9,
        kernel_overhead=4e-6,
        source="NVIDIA H100 Tensor Core GPU data sheet (SXM5); DGX H100 data sheet"),
}
# the A100 with 80 GB of HBM2e at 2.0 TB/s; the H200: the H100's compute with 141 GB of HBM3e
# at 4.8 TB/s (HGX H200, 8 per node)
PRESETS["a100-80gb"] = dataclasses.replace(
    PRESETS["a100-40gb"], name="a100-80gb", memory=80 * 2**30, memory_bandwidth=2039 * GB,
    source="NVIDIA A100 Tensor Core GPU data sheet (SXM4 80 GB); DGX A100 data sheet")
PRESETS["h200"] = dataclasses.replace(
    PRESETS["h100"], name="h200", memory=141 * GB, memory_bandwidth=4800 * GB,
    source="NVIDIA H200 Tensor Core GPU data sheet (SXM); HGX H200")

_FILE_HELP = (
    "a JSON or TOML file with the fields of autotp.planner.job.hardware.Hardware: name, flops "
    "(peak FLOP/s per dtype, e.g. {\"bfloat16\": 989e12}), memory (bytes), memory_bandwidth, "
    "intra_node_bandwidth, inter_node_bandwidth (bytes/s per GPU), and optionally "
    "gpus_per_node, latencies, efficiencies (`autotp estimate --calibrate -o FILE` writes one "
    "from measurements on a GPU)")


def hardware(spec: Any) -> Hardware:
    """A preset by name, a ``Hardware``, or a JSON/TOML file describing one."""
    if isinstance(spec, Hardware):
        return spec
    text = str(spec)
    if text.lower() in PRESETS:
        return PRESETS[text.lower()]
    if os.path.isfile(text):
        return load(text)
    raise ConfigError(f"unknown hardware {text!r}: use one of {', '.join(PRESETS)}, or "
                      f"{_FILE_HELP}")


def load(path: str) -> Hardware:
    with open(path, "rb") as handle:
        raw = handle.read()
    try:
        if path.endswith(".toml"):
            import tomllib  # optional: Python 3.11+ (a .toml file only)

            data = tomllib.loads(raw.decode())
        else:
            data = json.loads(raw)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"cannot read hardware file {path}: {exc}\n  expected {_FILE_HELP}") \
            from exc
    names = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(data) - names)
    missing = sorted(f.name for f in dataclasses.fields(Hardware)
                     if f.default is dataclasses.MISSING and f.name not in data)
    if unknown or missing:
        raise ConfigError(f"hardware file {path}: " + "; ".join(
            part for part in (f"unknown field(s) {', '.join(unknown)}" if unknown else "",
                              f"missing field(s) {', '.join(missing)}" if missing else "")
            if part) + f"\n  expected {_FILE_HELP}")
    data["flops"] = {str(k): float(v) for k, v in data["flops"].items()}
    return Hardware(**data)


def save(hw: Hardware, path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(hw.to_dict(), handle, indent=1)
        handle.write("\n")


# ---- calibration: measure the device at hand ---------------------------------------------


@dataclass
class Measurement:
    """What ``calibrate`` timed: (size, seconds) pairs, kept for the report."""

    gemms: list[tuple[int, float, float]] = field(default_factory=list)  # n, flops, seconds
    copies: list[tuple[float, float]] = field(default_factory=list)  # bytes, seconds
    collectives: list[tuple[float, float]] = field(default_factory=list)  # bytes, seconds


def _timed(fn: Any, device: Any, repeats: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _fit_gemm(points: list[tuple[int, float, float]], peak: float) -> tuple[float, float]:
    """Least squares of ``seconds = (flops + knee) / (peak * eff)``: a line in flops."""
    xs = [f for _, f, _ in points]
    ys = [t for _, _, t in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / \
        max(sum((x - mx) ** 2 for x in xs), 1e-30)
    slope = max(slope, 1e-30)
    intercept = max(my - slope * mx, 0.0)
    eff = min(1.0, 1.0 / (slope * peak))
    return eff, intercept / slope


def calibrate(base: Hardware, *, dtype: str = "bfloat16", device: Optional[str] = None,
              group: Any = None, sizes: Optional[tuple[int, ...]] = None,
              repeats: int = 5) -> tuple[Hardware, Measurement]:
    """Measure GEMM throughput, memory bandwidth, the host and device cost of one kernel
    and (with a process group of 2 or more ranks) all-reduce bandwidth and ring step latency
    on this device; return ``base`` with the measured numbers."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if sizes is None:
        sizes = (512, 1024, 2048, 4096, 8192) if dev.type == "cuda" else (128, 256, 512)
    torch_dtype = getattr(torch, dtype if dtype != "tfloat32" else "float32")
    m = Measurement()
    for n in sizes:
        a = torch.randn(n, n, device=dev, dtype=torch_dtype)
        b = torch.randn(n, n, device=dev, dtype=torch_dtype)
        m.gemms.append((n, 2.0 * n**3, _timed(lambda a=a, b=b: a @ b, dev, repeats)))
    best = max(flops / t for _, flops, t in m.gemms)
    # a GPU is measured against its data-sheet peak; any other device's peak is its best rate
    peak = base.flops.get(dtype, best) if dev.type == "cuda" else best
    eff, knee = _fit_gemm(m.gemms, peak)
    big = torch.empty((256 if dev.type == "cuda" else 32) * 2**20, dtype=torch.uint8,
                      device=dev)
    out = torch.empty_like(big)
    copy = _timed(lambda: out.copy_(big), dev, repeats)
    m.copies.append((2.0 * big.numel(), copy))  # read + write
    bandwidth = 2.0 * big.numel() / copy
    fields: dict[str, Any] = dict(
        name=f"{base.name}-calibrated", gemm_efficiency=eff, gemm_knee=float(knee),
        flops={**base.flops, dtype: peak},
        memory_efficiency=min(1.0, bandwidth / base.memory_bandwidth),
        attention_efficiency=min(1.0, _attention_rate(dev, torch_dtype, repeats) / peak),
        optimizer_efficiency=min(1.0, _optimizer_rate(dev, torch_dtype, repeats) /
                                 base.memory_bandwidth),
        **_launch_overheads(dev, repeats),
        source=f"measured by autotp estimate --calibrate on {_device_name(dev)} ({dtype}), "
               f"starting from {base.name}")
    if group is not None or (dist.is_available() and dist.is_initialized()):
        world = dist.get_world_size(group)
        if world > 1:
            times = []
            for nbytes in (1 << 20, 1 << 24, 1 << 28):
                t = torch.ones(nbytes // 2, dtype=torch.float16, device=dev)
                seconds = _timed(lambda t=t: dist.all_reduce(t, group=group), dev, repeats)
                m.collectives.append((float(nbytes), seconds))
                times.append((nbytes, seconds))
            (b0, t0), (b1, t1) = times[0], times[-1]
            bus = 2.0 * (world - 1) / world * (b1 - b0) / max(t1 - t0, 1e-9)
            # the line's intercept is the latency of the whole ring at the sizes training
            # moves (not a tiny message's, which NCCL sends with its low-latency protocol);
            # one world size cannot separate the launch from the steps, so the launch stays
            # the preset's (NCCL's base) and the rest is spread over the 2 (world - 1) steps
            ring = max(t0 - 2.0 * (world - 1) / world * b0 / bus, 0.0)
            fields.update(intra_node_bandwidth=bus / base.collective_efficiency,
                          intra_node_step_latency=max(ring - base.intra_node_latency, 0.0) /
                          (2 * (world - 1)))
    return dataclasses.replace(base, **fields), m


def _attention_rate(dev: Any, dtype: Any, repeats: int) -> float:
    """FLOP/s of a causal scaled-dot-product attention (16 heads of 128)."""
    batch, seq = (2, 4096) if dev.type == "cuda" else (1, 256)
    q, k, v = (torch.randn(batch, 16, seq, 128, device=dev, dtype=dtype) for _ in range(3))
    seconds = _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), dev,
                     repeats)
    return 4.0 * batch * 16 * seq * seq * 128 / 2 / seconds


def _optimizer_rate(dev: Any, dtype: Any, repeats: int) -> float:
    """Bytes/s of torch's AdamW (fused on a GPU) and zeroing the gradients, counted as
    ``Precision.optimizer_bytes_moved`` plus the zeroing's write."""
    size = (16 if dev.type == "cuda" else 1) * 2**20
    params = [torch.zeros(size, device=dev, dtype=dtype, requires_grad=True)
              for _ in range(8)]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-5, fused=dev.type == "cuda")

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=False)

    seconds = _timed(step, dev, repeats)
    width = params[0].element_size()  # weights, gradients and both moments in one dtype
    moved = Precision("calibration", width, width, 2 * width).optimizer_bytes_moved
    return 8 * size * moved / seconds


def _launch_overheads(dev: Any, repeats: int, kernels: int = 200) -> dict[str, float]:
    """Per-op host time (a loop of eager one-element ops: the device finishes each before
    the host issues the next) and, on a GPU, per-kernel device time (the same kernels
    replayed from a CUDA graph, which takes the host out)."""
    tiny = torch.zeros(1, device=dev)

    def eager() -> None:
        for _ in range(kernels):
            tiny.add_(1.0)

    out = {"host_overhead": _timed(eager, dev, repeats) / kernels}
    if dev.type == "cuda":
        eager()
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        out["kernel_overhead"] = _timed(graph.replay, dev, repeats) / kernels
    return out


def _device_name(dev: Any) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return "cpu"
