"""autotp with torch.distributed's data parallelism and activation checkpointing.

    python -m benchmarks.compose                       # LLaMA h=512, 8 layers, B=8, T=256
    python -m benchmarks.compose --layers 4 --steps 3

1. Activation memory per rank at tp=2, with and without ``checkpoint_wrapper`` around each
   of the sharded model's layers: the bytes kept from one training forward for backward,
   each storage once, parameters not counted (``autotp.verification.saved_tensors``). Without
   checkpointing that is what autograd saves; with it, what autograd saves outside the
   checkpointed layers plus the inputs each layer keeps for its recomputation.
2. Training step time on 4 gloo processes (informative on a CPU machine where the ranks
   share its cores): ``dp4`` (FSDP2 per layer on the unsharded model), ``tp4`` (autotp),
   ``dp2xtp2`` (autotp over "tp", FSDP2 per layer over "dp"), the same global batch, AdamW;
   the median of the steps after a warm-up one.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from benchmarks.harness import time_call


def build(args: argparse.Namespace) -> Any:
    import transformers as tf

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=args.vocab, max_position_embeddings=args.seq)).train()


def batch(args: argparse.Namespace) -> torch.Tensor:
    return torch.randint(0, args.vocab, (args.batch, args.seq),
                         generator=torch.Generator().manual_seed(1))


def activation_bytes(args: argparse.Namespace) -> dict[str, int]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    import autotp
    from autotp.verification.saved_tensors import count_saved

    model = build(args)
    ids = batch(args)
    sim = autotp.simulate(model, 2, example_kwargs={"input_ids": ids[:2, :16],
                                                   "labels": ids[:2, :16]})

    def measure(m: Any) -> int:
        with count_saved(exclude=m.parameters()) as saved:
            def inputs_kept(_module: Any, inputs: tuple[Any, ...]) -> None:
                for t in inputs:  # what a checkpointed layer keeps to recompute from
                    if isinstance(t, torch.Tensor):
                        saved.add(t)

            hooks = [layer.register_forward_pre_hook(inputs_kept) for layer in m.model.layers
                     if hasattr(layer, "_checkpoint_wrapped_module")]
            loss = m(input_ids=ids, labels=ids).loss
        for hook in hooks:
            hook.remove()
        del loss
        return saved.nbytes

    plain = max(sim.run(measure))

    def wrap(m: Any) -> None:
        for i, layer in enumerate(m.model.layers):
            m.model.layers[i] = checkpoint_wrapper(layer)

    sim.run(wrap)
    return {"plain": plain, "checkpointed": max(sim.run(measure))}


def step_worker(rank: int, world: int, mode: str, args: argparse.Namespace) -> float:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import autotp

    torch.set_num_threads(1)
    model = build(args)
    ids = batch(args)
    if mode == "dp4":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        mine = ids.chunk(world)[rank]
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        module: Any = fully_shard(model, mesh=mesh)
    elif mode == "tp4":
        mine = ids
        module = autotp.parallelize(model, tp=world,
                                    example_kwargs={"input_ids": ids, "labels": ids})
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        mine = ids.chunk(2)[mesh["dp"].get_local_rank()]
        module = autotp.parallelize(model, group=mesh["tp"],
                                    example_kwargs={"input_ids": mine, "labels": mine})
        for layer in module.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step() -> None:
        module(input_ids=mine, labels=mine).loss.backward()
        opt.step()
        opt.zero_grad()

    def slowest(seconds: float) -> float:  # the slowest rank's time of the step
        elapsed = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    return time_call(step, warmup=1, repeats=args.steps, before=dist.barrier,
                     combine=slowest).median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from autotp.runtime.launch import run_processes

    print(f"LLaMA h={args.hidden}, {args.layers} layers, 8 heads, 4 k/v heads, vocab "
          f"{args.vocab}; B={args.batch}, T={args.seq}; fp32; {os.cpu_count()} cores")
    memory = activation_bytes(args)
    mib = 1 << 20
    print(f"activation memory per rank at tp=2: {memory['plain'] / mib:.1f} MiB without, "
          f"{memory['checkpointed'] / mib:.1f} MiB with per-layer checkpointing "
          f"({memory['checkpointed'] / memory['plain']:.3f}x)")
    for mode in ("dp4", "tp4", "dp2xtp2"):
        step = run_processes(step_worker, 4, mode, args, timeout=3600)[0]
        print(f"{mode:>8}: {1e3 * step:8.1f} ms per training step (4 processes)")


if __name__ == "__main__":
    main()
