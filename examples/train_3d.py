"""Pipeline x data x tensor parallelism on one ("pp", "dp", "tp") DeviceMesh.

    torchrun --nproc-per-node 8 examples/train_3d.py --pp 2 --dp 2 --tp 2 --check
    torchrun --nproc-per-node 4 examples/train_3d.py --pp 2 --dp 1 --tp 2 --stages-per-rank 2
    torchrun --nproc-per-node 8 examples/train_3d.py --pp 2 --dp 2 --tp 2 --ep 2 --check
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/train_3d.py --pp 4 --dp 1 --tp 8 --layers 32

autotp shards an unmodified transformers LLaMA over "tp" and cuts it between its layers into
pipeline stages over "pp" (``autotp.pipeline_stages``); FSDP2 shards every layer of every
stage, and the rest of the stage, over "dp" (for the zero-bubble schedules, whose backward
is split, the whole stage only); optionally each layer is wrapped in activation
checkpointing first. torch's own schedules run the stages. Each dp rank trains on its slice
of the global batch, cut into microbatches. ``--check`` also trains the unsharded model on the
whole batch on every rank and prints the largest difference of the losses. Both clip their
gradients by the whole model's norm (``--max-grad-norm``): ``autotp.clip_grad_norm_`` over the
stages sums it over tp, dp (FSDP2's shards), ep and pp, each tied parameter once.

``--moe`` trains a mixture-of-experts model (Qwen3-MoE) instead of LLaMA, and ``--ep`` (equal
to ``--dp``) splits its experts over the dp ranks too, as examples/train_2d.py does: FSDP2
leaves the experts alone and ``autotp.finish_expert_gradients`` scales their gradients.

Keep tp within a node (its all-reduces are on the critical path of every layer); pp and dp
may cross nodes: the mesh's last dim is the one whose ranks are adjacent.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist

import autotp


# schedules whose backward is split into input and weight parts, and those placing the stages
# as a V (torch.distributed.pipelining's names)
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def main() -> None:
    import transformers
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleSingle,
        get_schedule_class,
    )

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--stages-per-rank", type=int, default=1,
                        help="virtual stages per pp rank (2 or more: an interleaved schedule)")
    parser.add_argument("--schedule", default=None,
                        help="a torch.distributed.pipelining schedule (GPipe, 1F1B, "
                             "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
                             "ZBVZeroBubble, DualPipeV); default 1F1B, or "
                             "Interleaved1F1B with --stages-per-rank > 1")
    parser.add_argument("--split-points", type=int, nargs="*", default=None,
                        help="the first layer of every stage but the first (default: balanced)")
    parser.add_argument("--microbatches", type=int, default=4, help="per step and dp rank")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16, help="global batch (split over dp)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--moe", action="store_true", help="Qwen3-MoE (8 experts) for LLaMA")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert parallelism over the dp ranks (implies --moe): 1 or --dp")
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="clip by the whole model's gradient norm (autotp.clip_grad_norm_)")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()

    transformers.logging.set_verbosity_error()
    device = autotp.api.default_device()  # cuda:LOCAL_RANK where there is CUDA, else the CPU
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.get_world_size() != args.pp * args.dp * args.tp:
        raise SystemExit(f"--pp {args.pp} x --dp {args.dp} x --tp {args.tp} must equal the "
                         f"world size {dist.get_world_size()}")
    if args.batch % (args.dp * args.microbatches):
        raise SystemExit(f"--batch {args.batch} must be divisible by --dp {args.dp} x "
                         f"--microbatches {args.microbatches}")
    if args.ep not in (1, args.dp):
        raise SystemExit(f"--ep {args.ep}: 1, or the dp size {args.dp}")
    mesh = init_device_mesh(device.type, (args.pp, args.dp, args.tp),
                            mesh_dim_names=("pp", "dp", "tp"))

    torch.manual_seed(0)
    shape = dict(num_hidden_layers=args.layers, hidden_size=args.hidden,
                 intermediate_size=args.hidden * 8 // 3 // 16 * 16, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=1024, max_position_embeddings=args.seq)
    if args.moe or args.ep > 1:
        config = transformers.Qwen3MoeConfig(**shape, num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=args.hidden // 2)
        model = transformers.Qwen3MoeForCausalLM(config).to(device)
    else:
        config = transformers.LlamaConfig(**shape)
        model = transformers.LlamaForCausalLM(config).to(device)
    reference = copy.deepcopy(model) if args.check else None
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1)).to(device)
    labels = torch.roll(ids, -1, dims=1)
    dp_rank = mesh["dp"].get_local_rank()
    mine, my_labels = ids.chunk(args.dp)[dp_rank], labels.chunk(args.dp)[dp_rank]
    microbatch = mine[: mine.shape[0] // args.microbatches]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    name = args.schedule or ("1F1B" if args.stages_per_rank == 1 else "Interleaved1F1B")
    schedule_class = get_schedule_class(name)
    single = issubclass(schedule_class, PipelineScheduleSingle)
    if single and args.stages_per_rank != 1:
        raise SystemExit(f"schedule {name} runs one stage per rank: use --stages-per-rank 1")
    v_shaped = name in V_SCHEDULES  # rank r holds stages r and 2 pp - 1 - r
    if v_shaped and args.stages_per_rank != 2:
        raise SystemExit(f"schedule {name} runs two stages per rank: use --stages-per-rank 2")
    stages = autotp.pipeline_stages(model, mesh, stages_per_rank=args.stages_per_rank,
                                    split_points=args.split_points,
                                    placement="v" if v_shaped else "loop",
                                    example_kwargs={"input_ids": microbatch},
                                    ep_group=mesh["dp"] if args.ep > 1 else None)
    del model
    for stage in stages:
        # with expert parallelism each dp rank holds other experts: FSDP2 must not average them
        experts = set(autotp.expert_parameters(stage).values()) if args.ep > 1 else set()
        layers = autotp.integrations.pipeline.stage_layers(stage)
        if args.checkpointing:
            wrap = {id(layer) for layer in layers}
            apply_activation_checkpointing(stage.submod,
                                           check_fn=lambda m, wrap=wrap: id(m) in wrap)
            layers = autotp.integrations.pipeline.stage_layers(stage)
        if name not in SPLIT_BACKWARD:  # torch's split backward needs FSDP2 on the stage only
            for layer in layers:
                fully_shard(layer, mesh=mesh["dp"], ignored_params=experts)
        fully_shard(stage.submod, mesh=mesh["dp"], ignored_params=experts)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    schedule = schedule_class(stages[0] if single else stages,
                              n_microbatches=args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW([p for s in stages for p in s.submod.parameters()], lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3) if reference else None

    worst = worst_norm = 0.0
    for step in range(args.steps):
        losses: list[torch.Tensor] = []
        kwargs = {"target": my_labels, "losses": losses} if last else {}
        schedule.step(*((mine,) if first else ()), **kwargs)
        autotp.finish_expert_gradients(stages)
        norm = autotp.clip_grad_norm_(stages, args.max_grad_norm)  # over tp, dp, ep and pp
        opt.step()
        opt.zero_grad()
        # the loss is on the last pp rank (every tp rank of it); the mean over dp
        mean = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=device)
        dist.all_reduce(mean)
        mean /= args.dp * args.tp
        line = f"step {step}: loss {float(mean):.5f}, grad norm {float(norm):.5f}"
        if reference is not None and ref_opt is not None:
            ref_loss = loss_fn(reference(ids).logits, labels)
            ref_loss.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), args.max_grad_norm)
            ref_opt.step()
            ref_opt.zero_grad()
            worst = max(worst, abs(float(mean) - float(ref_loss.detach())))
            worst_norm = max(worst_norm, abs(float(norm) - float(ref_norm)) / float(ref_norm))
            line += f" (unsharded {float(ref_loss.detach()):.5f}, norm {float(ref_norm):.5f})"
        if dist.get_rank() == 0:
            print(line, flush=True)
    local = sum(getattr(p, "to_local", p.detach)().numel()
                for s in stages for p in s.submod.parameters())
    if dist.get_rank() == 0:
        total = sum(p.numel() for p in reference.parameters()) if reference else None
        print(f"pp={args.pp} x dp={args.dp} x tp={args.tp}, ep={args.ep}, {name}, "
              f"{args.stages_per_rank} stage(s) per rank, activation checkpointing "
              f"{'on' if args.checkpointing else 'off'}; local parameters on rank 0: {local}"
              + (f" of {total}" if total else ""))
        if args.check:
            print(f"largest loss difference to the unsharded model: {worst:.2e}; "
                  f"gradient norm: {worst_norm:.2e} relative")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
