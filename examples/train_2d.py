"""Data x tensor parallelism: autotp inside a tensor-parallel group, FSDP2 across them.

    torchrun --nproc-per-node 4 examples/train_2d.py --dp 2 --tp 2
    torchrun --nproc-per-node 4 examples/train_2d.py --dp 2 --tp 2 --checkpointing --check
    torchrun --nproc-per-node 4 examples/train_2d.py --dp 2 --tp 2 --ep 2 --check
    torchrun --nnodes 2 --nproc-per-node 8 ... examples/train_2d.py --dp 2 --tp 8

A (dp, tp) DeviceMesh: autotp shards an unmodified transformers LLaMA over "tp"; FSDP2 shards
each of the sharded model's layers (``sharded.model.layers``, the original names) and the rest
over "dp"; optionally each layer is wrapped in activation checkpointing first. Each dp rank
trains on its slice of the global batch. ``--check`` also trains the unsharded model on the
whole batch on every rank and prints the largest loss difference.

``--ep`` trains a mixture-of-experts model (Qwen3-MoE) with expert parallelism over the "dp"
ranks (``--ep`` equal to ``--dp``): each rank holds experts / (tp * ep) experts whole, the
rows routed to them arrive by all-to-all. FSDP2 leaves the experts alone (their gradients
already sum every dp rank's tokens) and ``finish_expert_gradients`` scales them as FSDP2
averages the rest.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist

import autotp


def main() -> None:
    import transformers
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="global batch (split over dp)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--ep", type=int, default=1,
                        help="expert parallelism over the dp ranks: 1 (a dense LLaMA) or --dp "
                             "(a mixture-of-experts model, experts split over dp x tp)")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="clip by the whole model's gradient norm (autotp.clip_grad_norm_)")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()

    transformers.logging.set_verbosity_error()
    device = autotp.api.default_device()  # cuda:LOCAL_RANK where there is CUDA, else the CPU
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.get_world_size() != args.dp * args.tp:
        raise SystemExit(f"--dp {args.dp} x --tp {args.tp} must equal the world size "
                         f"{dist.get_world_size()}")
    if args.batch % args.dp:
        raise SystemExit(f"--batch {args.batch} must be divisible by --dp {args.dp}")
    if args.ep not in (1, args.dp):
        raise SystemExit(f"--ep {args.ep}: 1, or the dp size {args.dp}")
    mesh = init_device_mesh(device.type, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)
    if args.ep > 1:
        config = transformers.Qwen3MoeConfig(
            num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=args.seq,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
        model = transformers.Qwen3MoeForCausalLM(config).to(device)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256,
                                          intermediate_size=688, num_attention_heads=8,
                                          num_key_value_heads=2, vocab_size=1024,
                                          max_position_embeddings=args.seq)
        model = transformers.LlamaForCausalLM(config).to(device)
    reference = copy.deepcopy(model) if args.check else None
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1)).to(device)
    mine = ids.chunk(args.dp)[mesh["dp"].get_local_rank()]

    sharded = autotp.parallelize(model, group=mesh["tp"],
                                 ep_group=mesh["dp"] if args.ep > 1 else None,
                                 example_kwargs={"input_ids": mine, "labels": mine})
    # with expert parallelism each dp rank holds other experts: FSDP2 must not average them
    experts = set(sharded.expert_parameters().values()) if args.ep > 1 else set()
    layers = sharded.model.layers
    for i, layer in enumerate(layers):
        if args.checkpointing:
            layers[i] = layer = checkpoint_wrapper(layer)
        fully_shard(layer, mesh=mesh["dp"], ignored_params=experts)
    fully_shard(sharded, mesh=mesh["dp"], ignored_params=experts)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3) if reference else None

    worst = 0.0
    for step in range(args.steps):
        loss = sharded(input_ids=mine, labels=mine).loss
        loss.backward()
        sharded.finish_expert_gradients()
        norm = autotp.clip_grad_norm_(sharded, args.max_grad_norm)  # over tp, dp and ep
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())
        mean /= args.dp
        line = f"step {step}: loss {float(mean):.5f}, grad norm {float(norm):.5f}"
        if reference is not None and ref_opt is not None:
            ref_loss = reference(input_ids=ids, labels=ids).loss
            ref_loss.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), args.max_grad_norm)
            ref_opt.step()
            ref_opt.zero_grad()
            worst = max(worst, abs(float(mean) - float(ref_loss.detach())))
            line += f" (unsharded {float(ref_loss.detach()):.5f}, norm {float(ref_norm):.5f})"
        if dist.get_rank() == 0:
            print(line)
    if dist.get_rank() == 0:
        print(f"dp={args.dp} x tp={args.tp}, ep={args.ep}, activation checkpointing "
              f"{'on' if args.checkpointing else 'off'}; local parameters on rank 0: "
              f"{sum(getattr(p, 'to_local', p.detach)().numel() for p in sharded.parameters())}")
        if args.check:
            print(f"largest loss difference to the unsharded model: {worst:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
