"""Functions run inside real worker processes by ``autotp.runtime.launch.run_processes``."""

from __future__ import annotations

from typing import Any

import torch


def each_case(rank: int, world_size: int, case: Any, arg_lists: list[tuple]) -> list[Any]:
    """``case`` once per argument tuple in one worker process: on 2 cores a process's
    start-up (importing torch and transformers) costs more than a small model's case."""
    return [case(rank, world_size, *args) for args in arg_lists]


def equivalence_case(rank: int, world_size: int, name: str, labels: bool = False,
                     device: str = "cpu") -> dict[str, Any]:
    """parallelize ``name`` over the gloo group; compare with the unsharded model.

    With ``labels`` the model computes its own loss (HF ``labels=``) from gathered logits.
    ``device="cuda"``: model and inputs on the GPU (every rank on the same one).
    """
    import autotp
    from autotp.verification.verify import compare, layer_counts, reference_step, sharded_step
    from tests.models import BUILDERS, batch, example, loss_of, main_output

    torch.set_num_threads(1)
    model = BUILDERS[name]().to(device)
    args, kwargs = example(name)
    args = tuple(a.to(device) for a in args)
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    if labels:
        kwargs = {**kwargs, "labels": kwargs["input_ids"]}
    sharded = autotp.parallelize(model, tp=world_size, example_args=args,
                                 example_kwargs=kwargs)
    ids = batch().to(device)

    def call(m: torch.nn.Module) -> Any:
        return m(ids, labels=ids) if labels else m(ids)

    def loss(out: Any) -> torch.Tensor:
        return out.loss if labels else loss_of(out, ids)

    reference = reference_step(model, call, loss, main_output)
    got = sharded_step(sharded, call, loss, main_output)
    cmp = compare(reference, got)
    local = sum(p.numel() for p in sharded.parameters())
    return {
        "output_diff": cmp.output_diff,
        "loss_diff": cmp.loss_diff,
        "grad_diff": cmp.grad_diff,
        "grad_rel": cmp.grad_rel,
        "worst_param": cmp.worst_param,
        "counts": {(-1 if k is None else k): v for k, v in layer_counts(sharded.comm.log).items()},
        "local_params": local,
        "full_params": sum(p.numel() for p in model.parameters()),
    }


def vocab_sequence_case(rank: int, world_size: int, name: str, sequence_parallel: bool
                        ) -> dict[str, Any]:
    """HF ``labels=`` loss on vocabulary-sharded logits (returned sharded), optionally with
    sequence parallelism; compared with the unsharded model."""
    import torch.distributed as dist

    import autotp
    from autotp.verification.verify import compare, reference_step, sharded_step
    from tests.models import BUILDERS, VOCAB, batch

    torch.set_num_threads(1)
    model = BUILDERS[name]()
    example = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    sharded = autotp.parallelize(model, tp=world_size,
                                 example_kwargs={"input_ids": example, "labels": example},
                                 sequence_parallel=sequence_parallel, gather_outputs=False)
    ids = batch(t=12)

    def call(m: torch.nn.Module) -> Any:
        return m(input_ids=ids, labels=ids)

    reference = reference_step(model, call, lambda out: out.loss, lambda out: out.logits)
    got = sharded_step(sharded, call, lambda out: out.loss, lambda out: out.logits)
    pieces = [torch.empty_like(got.output) for _ in range(world_size)]
    dist.all_gather(pieces, got.output.contiguous())
    got.output = torch.cat(pieces, dim=-1)  # the logits are sharded over the vocabulary
    cmp = compare(reference, got)
    kinds: dict[str, dict[str, dict[str, int]]] = {}
    for e in sharded.comm.log.events:
        phase = kinds.setdefault(str(e.layer), {}).setdefault(e.phase, {})
        phase[e.kind] = phase.get(e.kind, 0) + 1
    return {
        "logits_diff": cmp.output_diff, "loss_diff": cmp.loss_diff, "grad_diff": cmp.grad_diff,
        "grad_rel": cmp.grad_rel, "kinds": kinds,
        "largest_collective": max(e.nbytes for e in sharded.comm.log.events),
        "logits_bytes": ids.numel() * VOCAB * 4,
    }


def reduce_scatter_case(rank: int, world_size: int, native: bool = True,
                        device: str = "cpu") -> dict[str, Any]:
    """ProcessGroupComm.reduce_scatter (native, or the all-reduce-and-slice path of gloo
    builds without one) and all_gather along dims 0 and 1: the results, and the input left
    untouched. On CUDA with NCCL this is the *_single path."""
    from autotp.runtime.comm import ProcessGroupComm

    if device == "cuda":  # NCCL: one GPU per rank
        device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    comm = ProcessGroupComm()
    comm.native_reduce_scatter = native
    base = torch.arange(8.0 * world_size, device=device).reshape(4 * world_size, 2)
    x = base * (rank + 1)
    before = x.clone()
    out = comm.reduce_scatter(x, 0)
    total = sum(r + 1 for r in range(world_size)) * base
    expected = total.chunk(world_size, 0)[rank]
    piece = torch.full((2, 3), float(rank), device=device)
    gathered = comm.all_gather(piece, 1)
    return {"result_ok": bool(torch.equal(out, expected)),
            "input_kept": bool(torch.equal(x, before)),
            "gather_ok": bool(torch.equal(gathered, torch.cat(
                [torch.full((2, 3), float(r), device=device) for r in range(world_size)],
                dim=1)))}



def mqa_llama() -> Any:
    """transformers' LLaMA with one k/v head: at tp=2 the k/v projections are whole and
    their gradients partial on each rank."""
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=96, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)).train()


def fsdp_case(rank: int, world_size: int, steps: int = 3) -> dict[bool, dict[str, Any]]:
    """dp2 x tp2 on a DeviceMesh: autotp over "tp", FSDP2 per layer and at the root over "dp",
    AdamW steps on each dp rank's half of the batch, against the unsharded model trained on
    the whole batch; without and with per-layer activation checkpointing."""
    return {checkpointing: _fsdp_run(world_size, checkpointing, steps)
            for checkpointing in (False, True)}


def expert_parallel_cases(rank: int, world_size: int) -> dict[str, Any]:
    """The expert-parallel runs of one launch of 4 processes: FSDP2 on (dp 2, tp 2) and on
    (dp 4, tp 1), and pipeline stages on (pp 2, dp 2)."""
    return {"fsdp dp 2": fsdp_expert_case(rank, world_size, 2),
            "fsdp dp 4": fsdp_expert_case(rank, world_size, 4),
            "pipeline": pipeline_expert_case(rank, world_size)}


def fsdp_expert_case(rank: int, world_size: int, dp: int, steps: int = 2) -> dict[str, Any]:
    """``fsdp_case`` on a (dp, world / dp) mesh with a mixture-of-experts model whose experts
    are split over dp x tp (expert parallelism over "dp"): FSDP2 ignores the experts,
    ``finish_expert_gradients`` scales their gradients as FSDP2 averages the others."""
    return _fsdp_run(world_size, False, steps, experts=True, dp=dp)


def _fsdp_run(world_size: int, checkpointing: bool, steps: int, experts: bool = False,
              dp: int = 2) -> dict[str, Any]:
    import copy

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import autotp

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dp, world_size // dp), mesh_dim_names=("dp", "tp"))
    if experts:
        from tests.models import qwen3_moe

        model = qwen3_moe().train()
    else:
        model = mqa_llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(1, 96, (4, 12), generator=torch.Generator().manual_seed(3))
    mine = ids.chunk(dp)[mesh["dp"].get_local_rank()]
    sharded = autotp.parallelize(model, group=mesh["tp"],
                                 ep_group=mesh["dp"] if experts else None,
                                 example_kwargs={"input_ids": mine, "labels": mine})
    ignored = set(sharded.expert_parameters().values()) if experts else set()
    layers = sharded.model.layers
    for i, layer in enumerate(layers):
        if checkpointing:
            layers[i] = layer = checkpoint_wrapper(layer)
        fully_shard(layer, mesh=mesh["dp"], ignored_params=ignored)
    fully_shard(sharded, mesh=mesh["dp"], ignored_params=ignored)
    result = train_against_reference(sharded, reference, {"input_ids": mine, "labels": mine},
                                     {"input_ids": ids, "labels": ids}, steps,
                                     mesh["dp"].get_group(), dp)
    return {
        **result,
        "fsdp_layers": [type(layer).__name__ for layer in sharded.model.layers],
        "experts_held": sorted({int(p.shape[0]) for p in ignored}),
        "expert_moves": len(sharded.ep_comm.log.events) if sharded.ep_comm else 0,
    }


def train_against_reference(sharded: Any, reference: Any, mine: dict[str, Any],
                            whole: dict[str, Any], steps: int, dp_group: Any,
                            dp: int) -> dict[str, Any]:
    """AdamW steps (lr 1e-3) of ``sharded`` on this data-parallel rank's inputs ``mine`` and of
    the unsharded ``reference`` on the whole batch, both clipped to half the whole model's
    gradient norm (``autotp.clip_grad_norm_``: the norm over every tp, cp, ep and FSDP2
    shard must be the unsharded model's, or the steps differ): the first step's gradients,
    the norms, the dp-mean losses and the parameters after the steps, against the
    reference's."""
    import torch.distributed as dist

    import autotp
    from autotp.verification.verify import max_difference

    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    losses, ref_losses, grad_diff, norm_diff = [], [], 0.0, 0.0
    for step in range(steps):
        loss = sharded(**mine).loss
        loss.backward()
        sharded.finish_expert_gradients()
        ref_loss = reference(**whole).loss
        ref_loss.backward()
        if step == 0:  # FSDP2 averaged the dp ranks' gradients: the whole batch's
            grads = autotp.full_state_dict(sharded, grads=True)
            grad_diff = max_difference({n: p.grad for n, p in reference.named_parameters()},
                                       grads)
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
        torch.nn.utils.clip_grad_norm_(reference.parameters(), float(want) / 2)
        got = autotp.clip_grad_norm_(sharded, float(want) / 2)
        norm_diff = max(norm_diff, abs(float(got) - float(want)) / float(want))
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)
        losses.append(float(mean) / dp)
        ref_losses.append(float(ref_loss.detach()))
    full = autotp.full_state_dict(sharded)
    want = dict(reference.named_parameters())
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "grad_diff": grad_diff, "norm_diff": norm_diff, "losses": losses,
            "param_diff": max_difference(want, full), "names": sorted(full) == sorted(want)}


def tiny_llama() -> Any:
    from tests.models import llama_config, quiet_transformers

    tf = quiet_transformers()
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(llama_config(num_hidden_layers=4, intermediate_size=128,
                                            num_attention_heads=4, vocab_size=96))


def tiny_gpt2() -> Any:
    from tests.models import gpt2_config, quiet_transformers

    tf = quiet_transformers()
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(gpt2_config(n_layer=4, n_head=4, vocab_size=96))  # tied


def _token_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(1))
    return ids, torch.roll(ids, -1, dims=1)


def _next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _reference_training(model: Any, ids: torch.Tensor, labels: torch.Tensor, steps: int
                        ) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """A copy of ``model`` trained on the whole batch with AdamW: the loss and the gradients
    of every step."""
    import copy

    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, grads = [], []
    for _ in range(steps):
        loss = _next_token_loss(reference(ids).logits, labels)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in reference.named_parameters()})
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return losses, grads


def _pipeline_step(schedule: Any, stages: list[Any], ids: torch.Tensor,
                   labels: torch.Tensor) -> torch.Tensor:
    """One schedule step; the mean microbatch loss where this rank holds the last stage,
    else zero."""
    losses: list[torch.Tensor] = []
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    schedule.step(*((ids,) if first else ()),
                  **({"target": labels, "losses": losses} if last else {}))
    return torch.stack(losses).mean().detach() if losses else torch.tensor(0.0)


def _stage_grad_diff(stages: list[Any], want: dict[str, torch.Tensor], tp_rank: int,
                     tp: int, ep_rank: int = 0, ep: int = 1) -> dict[str, float]:
    """The largest difference of the stages' gradients (gathered over dp where FSDP2 shards
    them) to this tp rank's slices of the unsharded gradients, each relative to the
    unsharded gradient's largest |value|: over the parameters that several stages read
    (tied) under ``tied`` (absent where this rank holds none), over the others under
    ``untied``."""
    import autotp
    from autotp.verification.verify import max_difference
    from autotp.layout import Shard, shard_tensor

    autotp.integrations.pipeline.wait_tied_grads()  # before reading gradients by hand
    plan = stages[0].part.plan
    tied = set(stages[0].part.first_holder)
    worst: dict[str, float] = {"untied": 0.0}
    for stage in stages:
        for name, p in stage.submod.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            layout = plan.param_layout(name)
            expected = want[name]
            if name in plan.expert_params and ep > 1:  # experts split tp * ep ways
                expected = shard_tensor(expected, layout, ep_rank * tp + tp_rank, tp * ep)
            elif isinstance(layout, Shard):
                expected = shard_tensor(expected, layout, tp_rank, tp)
            kind = "tied" if name in tied else "untied"
            scale = max(float(want[name].abs().max()), 1e-30)  # the whole gradient's
            worst[kind] = max(worst.get(kind, 0.0), max_difference(expected, grad) / scale)
    return worst


def _norm_diff(stages: list[Any], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """``autotp.clip_grad_norm_`` over this rank's stages (a limit it does not reach: the
    gradients stay as they are), of order 2 and infinity, against the unsharded model's
    gradient norms (each tied parameter once), relative."""
    import math

    import autotp

    got = {"2": float(autotp.clip_grad_norm_(stages, math.inf)),
           "inf": float(autotp.clip_grad_norm_(stages, math.inf, math.inf))}
    grads = list(want.values())
    norms = {"2": float(torch.stack([g.norm() for g in grads]).norm()),
             "inf": max(float(g.abs().max()) for g in grads)}
    return {k: abs(got[k] - norms[k]) / norms[k] for k in norms}


def _train_stages(schedule: Any, stages: list[Any], mesh: Any, ids: torch.Tensor,
                  labels: torch.Tensor, ref_grads: list[dict[str, torch.Tensor]]
                  ) -> tuple[list[float], list[dict[str, float]], list[dict[str, float]]]:
    """AdamW steps (lr 1e-2) of ``schedule`` over this rank's ``stages``, one per reference
    gradient: the losses summed over "pp", each step's gradients against this tp rank's
    slices of the reference's (``_stage_grad_diff``) and the clipping norms (``_norm_diff``)."""
    opt = torch.optim.AdamW([p for s in stages for p in s.submod.parameters()], lr=1e-2)
    losses, grad_diffs, norm_diffs = [], [], []
    for want in ref_grads:
        total = _pipeline_step(schedule, stages, ids, labels)
        torch.distributed.all_reduce(total, group=mesh["pp"].get_group())
        losses.append(float(total))
        grad_diffs.append(_stage_grad_diff(stages, want, mesh["tp"].get_local_rank(),
                                           mesh["tp"].size()))
        norm_diffs.append(_norm_diff(stages, want))
        opt.step()
        opt.zero_grad()
    return losses, grad_diffs, norm_diffs


def pipeline_case(rank: int, world_size: int, names: list[str], steps: int = 3
                  ) -> dict[str, dict[str, Any]]:
    """pp2 x tp2: Schedule1F1B with one stage per rank (LLaMA), ScheduleInterleaved1F1B with
    two and ScheduleZBVZeroBubble with two placed as a V (GPT-2, whose tied embedding and
    head are then on one rank), 4 microbatches, AdamW: the losses and each local gradient
    of every step against the unsharded model on the whole batch."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    import autotp

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    ids, labels = _token_batch()
    # LLaMA one stage per rank; GPT-2's tied embedding and head on two pp ranks (loop) and
    # on one (the V of ZBVZeroBubble, whose backward is split into input and weight parts)
    cases = {"llama": (tiny_llama, [("1f1b", 1, "loop", Schedule1F1B)]),
             "gpt2": (tiny_gpt2, [("interleaved", 2, "loop", ScheduleInterleaved1F1B),
                                  ("zbv", 2, "v", ScheduleZBVZeroBubble)])}
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        build, schedules = cases[name]
        original = build()
        ref_losses, ref_grads = _reference_training(original, ids, labels, steps)
        for kind, per_rank, placement, cls in schedules:
            stages = autotp.pipeline_stages(copy.deepcopy(original), mesh,
                                            stages_per_rank=per_rank, placement=placement,
                                            example_kwargs={"input_ids": ids[:2]})
            params = [p for s in stages for p in s.submod.parameters()]
            schedule = cls(stages[0] if per_rank == 1 else stages, n_microbatches=4,
                           loss_fn=_next_token_loss)
            losses, grad_diffs, norm_diffs = _train_stages(schedule, stages, mesh, ids,
                                                           labels, ref_grads)
            out[f"{name}-{kind}"] = {"losses": losses, "reference": ref_losses,
                                     "grad_diffs": grad_diffs, "norm_diffs": norm_diffs,
                                     "stage_params": sum(p.numel() for p in params),
                                     "full_params": sum(p.numel()
                                                        for p in original.parameters())}
    return out


def pipeline_3d_case(rank: int, world_size: int, steps: int = 3) -> dict[str, Any]:
    """dp2 x pp2 x tp2, mesh dims ("dp", "pp", "tp") (pp in the middle: pp rank r is
    ranks {2r, 2r + 1, 4 + 2r, 5 + 2r}), on GPT-2 (tied embedding and head across the pp
    ranks): ScheduleInterleaved1F1B with two stages per rank, FSDP2 over "dp" on every
    layer and stage, each dp rank on its half of the batch in 2 microbatches, AdamW. The
    dp-mean loss and each rank's gradients (gathered over dp) of every step against the
    unsharded model on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import ScheduleInterleaved1F1B
    from torch.distributed.tensor import DTensor

    import autotp

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    original = tiny_gpt2()
    ids, labels = _token_batch()
    mine, my_labels = ids.chunk(2)[dp_rank], labels.chunk(2)[dp_rank]
    ref_losses, ref_grads = _reference_training(original, ids, labels, steps)

    stages = autotp.pipeline_stages(original, mesh, stages_per_rank=2,
                                    example_kwargs={"input_ids": mine[:2]})
    for stage in stages:
        for layer in autotp.integrations.pipeline.stage_layers(stage):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(stage.submod, mesh=mesh["dp"])
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=2, loss_fn=_next_token_loss)
    losses, grad_diffs, norm_diffs = [], [], []
    for step in range(steps):
        total = _pipeline_step(schedule, stages, mine, my_labels)
        torch.distributed.all_reduce(total)  # over pp (one rank has it) and dp, and tp
        losses.append(float(total) / 4)  # 2 dp x 2 tp ranks hold the loss
        grad_diffs.append(_stage_grad_diff(stages, ref_grads[step],
                                           mesh["tp"].get_local_rank(), 2))
        norm_diffs.append(_norm_diff(stages, ref_grads[step]))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "reference": ref_losses, "grad_diffs": grad_diffs,
            "norm_diffs": norm_diffs, "fsdp": all(isinstance(p, DTensor) for p in params)}


def pipeline_expert_case(rank: int, world_size: int, steps: int = 2) -> dict[str, Any]:
    """pp2 x dp2 (tp 1), mesh dims ("pp", "dp", "tp"), Qwen3-MoE with its 4 experts split over
    the dp ranks too (ep 2: 2 per rank): Schedule1F1B, 2 microbatches, FSDP2 over "dp" on
    every layer and stage with the experts ignored, ``finish_expert_gradients``, AdamW. The
    dp-mean loss and each rank's gradients (the experts': its share) of every step against
    the unsharded model on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import Schedule1F1B

    import autotp
    from tests.models import qwen3_moe

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    original = qwen3_moe()
    ids, labels = _token_batch()
    mine, my_labels = ids.chunk(2)[dp_rank], labels.chunk(2)[dp_rank]
    ref_losses, ref_grads = _reference_training(original, ids, labels, steps)
    stages = autotp.pipeline_stages(original, mesh, example_kwargs={"input_ids": mine[:2]},
                                    ep_group=mesh["dp"])
    held = {}
    for stage in stages:
        experts = autotp.expert_parameters(stage)
        held.update({name: int(p.shape[0]) for name, p in experts.items()})
        for layer in autotp.integrations.pipeline.stage_layers(stage):
            fully_shard(layer, mesh=mesh["dp"], ignored_params=set(experts.values()))
        fully_shard(stage.submod, mesh=mesh["dp"], ignored_params=set(experts.values()))
    opt = torch.optim.AdamW([p for s in stages for p in s.submod.parameters()], lr=1e-2)
    schedule = Schedule1F1B(stages[0], n_microbatches=2, loss_fn=_next_token_loss)
    losses, grad_diffs, norm_diffs = [], [], []
    for step in range(steps):
        total = _pipeline_step(schedule, stages, mine, my_labels)
        autotp.finish_expert_gradients(stages)
        torch.distributed.all_reduce(total)  # one pp rank has it, on each dp rank
        losses.append(float(total) / 2)
        grad_diffs.append(_stage_grad_diff(stages, ref_grads[step], 0, 1, dp_rank, 2))
        norm_diffs.append(_norm_diff(stages, ref_grads[step]))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "reference": ref_losses, "grad_diffs": grad_diffs,
            "norm_diffs": norm_diffs, "experts_held": held}


def pipeline_checkpoint_case(rank: int, world_size: int, directory: str, steps: int = 2
                             ) -> dict[str, Any]:
    """tp2 x pp2, mesh dims ("tp", "pp") (pp rank r is ranks {r, 2 + r}), from a model built
    without weights: each rank reads only its stages' slices from ``directory`` (tiny_gpt2
    saved by transformers); ScheduleZBVZeroBubble with the stages as a V (the tied
    embedding and head both on the first pp rank), 4 microbatches, AdamW, against the
    unsharded model on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import ScheduleZBVZeroBubble

    import autotp
    from autotp.weights import materialize

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "pp"))
    reference = tiny_gpt2()
    with autotp.empty_weights():  # parameters on meta, buffers computed
        model = type(reference)(reference.config)
    ids, labels = _token_batch()
    ref_losses, _ = _reference_training(reference, ids, labels, steps)

    read: list[str] = []
    original = materialize.CheckpointWeights.parameter

    def counting(self: Any, target: str, *args: Any) -> torch.Tensor:
        read.append(target)
        return original(self, target, *args)

    materialize.CheckpointWeights.parameter = counting  # type: ignore[method-assign]
    try:
        stages = autotp.pipeline_stages(model, mesh, checkpoint=directory, stages_per_rank=2,
                                        placement="v", example_kwargs={"input_ids": ids[:2]})
    finally:
        materialize.CheckpointWeights.parameter = original  # type: ignore[method-assign]
    held = sorted(n for s in stages for n, _ in s.submod.named_parameters())
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=4, loss_fn=_next_token_loss)
    losses = []
    for _ in range(steps):
        total = _pipeline_step(schedule, stages, ids, labels)
        torch.distributed.all_reduce(total, group=mesh["pp"].get_group())
        losses.append(float(total))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "reference": ref_losses, "read": read, "held": held,
            "meta": any(p.is_meta for p in params)}



def pipeline_context_case(rank: int, world_size: int, steps: int = 2) -> dict[str, Any]:
    """pp 2 x cp 2 x tp (world_size / 4): ``autotp.pipeline_stages(..., cp=2,
    cp_group=mesh["cp"])`` of LLaMA, Schedule1F1B, 4 microbatches, AdamW: each stage's
    program on half of every sequence (the ring inside its attention layers), the losses
    and each local gradient of every step against the unsharded model on the whole batch."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    import autotp

    torch.set_num_threads(1)
    tp = world_size // 4
    mesh = init_device_mesh("cpu", (2, 2, tp), mesh_dim_names=("pp", "cp", "tp"))
    ids, labels = _token_batch()
    original = tiny_llama()
    ref_losses, ref_grads = _reference_training(original, ids, labels, steps)
    stages = autotp.pipeline_stages(copy.deepcopy(original), mesh,
                                    example_kwargs={"input_ids": ids[:2]}, cp=2,
                                    cp_group=mesh["cp"])
    params = [p for s in stages for p in s.submod.parameters()]
    schedule = Schedule1F1B(stages[0], n_microbatches=4, loss_fn=_next_token_loss)
    losses, grad_diffs, norm_diffs = _train_stages(schedule, stages, mesh, ids, labels,
                                                   ref_grads)
    context = stages[0].part.plan.on("cp")
    return {"losses": losses, "reference": ref_losses, "grad_diffs": grad_diffs,
            "norm_diffs": norm_diffs, "rings": sum(
                c.strategy.endswith("[ring]") for c in context.choices.values()),
            "stage_params": sum(p.numel() for p in params),
            "full_params": sum(p.numel() for p in original.parameters())}


def torch_styles_case(rank: int, world_size: int, name: str) -> dict[str, Any]:
    """Model ``name`` from the same weights: unsharded, ``autotp.parallelize``, torch's
    ``parallelize_module`` with autotp's plan exported as torch styles
    (``plan.to_tp_plan(style="torch").as_torch()``) and, for a transformers model,
    transformers' own ``apply_tensor_parallelism`` with the exported ``tp_plan`` (its ``*``
    patterns expanded by the model, as ``from_pretrained`` does); one forward and backward
    each, the outputs and whole gradients compared (tests/test_export.py)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import autotp
    from autotp.verification.verify import compare, reference_step, sharded_step
    from tests.models import BUILDERS, batch, example, loss_of, main_output

    torch.set_num_threads(1)
    model = BUILDERS[name]()
    args, kwargs = example(name)
    ids = batch()
    mesh = init_device_mesh("cpu", (world_size,))

    def call(m: torch.nn.Module) -> Any:
        return m(ids) if args else m(input_ids=ids)

    def loss(out: Any) -> torch.Tensor:
        return loss_of(out, ids)

    reference = reference_step(model, call, loss, main_output)
    plan = autotp.plan(model, world_size, example_args=args, example_kwargs=kwargs)
    export = plan.to_tp_plan(style="torch")
    steps = {"autotp": sharded_step(autotp.parallelize(copy.deepcopy(model), tp=world_size,
                                                       example_args=args,
                                                       example_kwargs=kwargs),
                                    call, loss, main_output)}
    styled = parallelize_module(copy.deepcopy(model), mesh, export.as_torch())
    steps["torch"] = _styled_step(styled, call, loss)
    if hasattr(model, "_expand_parallel_plan"):  # a transformers model
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        tf_model = copy.deepcopy(model)
        tp_plan = tf_model._expand_parallel_plan(plan.to_tp_plan().as_transformers())
        steps["transformers"] = _styled_step(apply_tensor_parallelism(tf_model, mesh, tp_plan),
                                             call, loss)
    scale = float(reference.output.abs().max())
    result: dict[str, Any] = {"not_expressible": dict(export.not_expressible),
                              "sharded": _dtensors(styled)}
    for label, got in steps.items():
        for against, want in (("unsharded", reference), ("autotp", steps["autotp"])):
            cmp = compare(want, got)
            result[f"{label} vs {against}"] = {
                "output_rel": cmp.output_diff / scale, "grad_rel": cmp.grad_rel,
                "worst_param": cmp.worst_param}
    return result


def _styled_step(model: torch.nn.Module, call: Any, loss: Any) -> Any:
    """One step of a model with DTensor parameters: its output, loss and whole gradients
    (``full_tensor``, in the same order on every rank)."""
    from torch.distributed.tensor import DTensor

    from autotp.verification.verify import StepResult, main_output

    out = call(model)
    value = loss(out)
    value.backward()
    grads = {}
    for key, param in model.named_parameters(remove_duplicate=False):
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        grads[key] = grad.detach().clone()
    return StepResult(main_output(out).detach().clone(), float(value.detach()), grads)


def _dtensors(model: torch.nn.Module) -> int:
    from torch.distributed.tensor import DTensor

    return sum(isinstance(p, DTensor) for p in model.parameters())
