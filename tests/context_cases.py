"""Cases of context-parallel attention (autotp.runtime.ring), run on every rank of a cp
group (threads or gloo processes): each rank attends with its shard of one global q, k, v
and returns its output and gradients beside the unsharded attention's, as the layout shards
them."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

import autotp
from autotp.verification.verify import compare, main_output, max_difference, reference_step, \
    sharded_step
from autotp.runtime.comm import Communicator, ThreadComm, ThreadHub
from autotp.runtime.ring import SequenceLayout, ring_attention, ulysses_attention


@dataclass(frozen=True)
class Case:
    heads: int = 4
    kv_heads: int = 4
    causal: bool = True
    balanced: bool = True
    window: Optional[int] = None
    padding: Optional[str] = None  # "right" or "left": the second sequence's 5 pad tokens
    length: int = 24  # 2 x cp chunks at cp 2, 3 and 4
    # the mask given as scaled_dot_product_attention's attn_mask (its rows this rank's
    # queries): "bool" or "additive" (0 or -inf); the ring only
    explicit: Optional[str] = None


CASES = {
    "causal": Case(),
    "causal-contiguous": Case(balanced=False),
    "bidirectional": Case(causal=False, balanced=False),
    "gqa": Case(heads=8, kv_heads=2),
    "gqa-6-3": Case(heads=6, kv_heads=3),
    "window": Case(window=5),
    "padding": Case(padding="right"),
    # causal with the pad tokens first: their queries see no key at all (zeros, no gradient)
    "left-padding": Case(padding="left"),
    "bidirectional-padding": Case(causal=False, balanced=False, padding="right"),
    "explicit-bool": Case(window=7, padding="left", explicit="bool"),
    "explicit-additive": Case(padding="right", explicit="additive"),
}


def inputs(case: Case) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    b, d, s = 2, 8, case.length
    q = torch.randn(b, case.heads, s, d, generator=gen)
    k = torch.randn(b, case.kv_heads, s, d, generator=gen)
    v = torch.randn(b, case.kv_heads, s, d, generator=gen)
    grad = torch.randn(b, case.heads, s, d, generator=gen)
    keys = torch.ones(b, s, dtype=torch.bool)
    if case.padding == "right":
        keys[1, s - 5:] = False
    elif case.padding == "left":
        keys[1, :5] = False
    return q, k, v, grad, keys


def mask_of(case: Case, keys: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s]: True where a query sees a key."""
    s = case.length
    pos = torch.arange(s)
    allowed = torch.ones(s, s, dtype=torch.bool)
    if case.causal:
        allowed = pos[None, :] <= pos[:, None]
    if case.window is not None:
        allowed &= pos[:, None] - pos[None, :] < case.window
    return allowed[None, None] & keys[:, None, None, :]


def reference(case: Case) -> dict[str, torch.Tensor]:
    """The unsharded attention: scaled_dot_product_attention over the whole sequence."""
    q, k, v, grad, keys = (t.clone() for t in inputs(case))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = mask_of(case, keys)
    empty = ~mask.any(-1, keepdim=True)  # a query no key is left for: zeros
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | empty,
                                         enable_gqa=case.heads != case.kv_heads)
    out = out.masked_fill(empty, 0.0)
    out.backward(grad)
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def run(comm: Communicator, case: Case, strategy: str) -> dict[str, float]:
    """This rank's shard through ``strategy``; the largest difference to the unsharded
    attention's output and gradients (each as this rank's shard of them)."""
    layout = SequenceLayout(comm.world_size, case.balanced)
    q, k, v, grad, keys = inputs(case)
    mine = [layout.shard(t, 2, comm.rank).requires_grad_() for t in (q, k, v)]
    if case.explicit:  # this rank's rows of the whole mask, as a model would build it
        assert strategy == "ring"
        rows = layout.shard(mask_of(case, keys), 2, comm.rank)
        if case.explicit == "additive":
            rows = torch.zeros(rows.shape).masked_fill(~rows, float("-inf"))
        out = ring_attention(*mine, comm, layout, attn_mask=rows)
    else:
        attend = ring_attention if strategy == "ring" else ulysses_attention
        out = attend(*mine, comm, layout, causal=case.causal, window=case.window,
                     key_mask=keys if case.padding else None)
    out.backward(layout.shard(grad, 2, comm.rank))
    want = reference(case)
    got = {"out": out.detach(), "q": mine[0].grad, "k": mine[1].grad, "v": mine[2].grad}
    for name, tensor in got.items():
        assert tensor is not None and bool(torch.isfinite(tensor).all()), (name, tensor)
    return {name: max_difference(layout.shard(want[name], 2, comm.rank), got[name],
                                 relative=True) for name in want}


def process_cases(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    """Every case and both strategies (Ulysses where the heads divide) in one gloo launch."""
    from autotp.runtime.comm import ProcessGroupComm

    comm = ProcessGroupComm()
    results = {}
    for name, case in CASES.items():
        for strategy in ("ring", "ulysses"):
            if strategy == "ulysses" and (case.heads % world_size or case.kv_heads % world_size
                                          or case.explicit):
                continue
            results[f"{name}-{strategy}"] = run(comm, case, strategy)
    results["shifts"] = {"forward": float(comm.log.count("forward", kind="shift",
                                                          any_layer=True))}
    return results


# ---- whole models under context parallelism -----------------------------------------------


# models outside transformers: the name of their token input; the loss is computed outside
PLAIN = {"nanogpt": "idx", "x_transformers": "x"}


def model_inputs(name: str, padded: bool) -> dict[str, torch.Tensor]:
    """Whole inputs, the same on every rank: 16 tokens (labels for the model's own loss; the
    second sequence left-padded by 4 where ``padded``)."""
    from tests import models

    ids = torch.randint(0, models.VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    if name in PLAIN:
        return {PLAIN[name]: ids}
    kwargs = {"input_ids": ids, "labels": ids}
    if padded:
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, :4] = 0
        kwargs["attention_mask"] = mask
    return kwargs


def model_loss(name: str, out: Any) -> torch.Tensor:
    from tests import models

    if name in PLAIN:  # next-token cross-entropy outside the model
        ids = model_inputs(name, False)[PLAIN[name]]
        return models.loss_of(out, ids)
    return out.loss


def model_output(name: str, out: Any) -> torch.Tensor:
    return main_output(out) if name in PLAIN else out.logits


def _step_functions(name: str, inputs: dict[str, torch.Tensor]) -> tuple[Any, Any, Any]:
    """The call, the loss and the output to compare, for ``verify``'s steps."""
    return (lambda m: m(**inputs), lambda out: model_loss(name, out),
            lambda out: model_output(name, out))


def process_models(rank: int, world_size: int, names: list[str], padded: bool,
                   saved: Optional[str] = None) -> dict[str, Any]:
    """``autotp.parallelize(model, tp=1, cp=world_size)`` of each model against the unsharded
    model: output, loss and every gradient (``verify.compare``); ``saved``: a LLaMA saved
    with ``save_pretrained`` there, loaded by ``autotp.from_pretrained(..., cp=)`` against
    transformers' own ``from_pretrained``; then the bad inputs."""
    from tests import models

    results: dict[str, Any] = {}
    if saved is not None:
        import transformers

        model = transformers.LlamaForCausalLM.from_pretrained(saved).eval()
        inputs = model_inputs("llama", padded)
        sharded = autotp.from_pretrained(saved, 1, cp=world_size, example_kwargs=inputs)
        call, loss, pick = _step_functions("llama", inputs)
        results["pretrained"] = compare(reference_step(model, call, loss, pick),
                                        sharded_step(sharded, call, loss, pick))
    for name in names:
        model = models.BUILDERS[name]().eval()
        inputs = model_inputs(name, padded and name not in PLAIN)
        sharded = autotp.parallelize(model, tp=1, cp=world_size, example_kwargs=inputs)
        call, loss, pick = _step_functions(name, inputs)
        results[name] = compare(reference_step(model, call, loss, pick),
                                sharded_step(sharded, call, loss, pick))
        results[f"{name}-rings"] = sum(c.strategy.endswith("[ring]")
                                       for c in sharded.plan.choices.values())
        results[f"{name}-ulysses"] = sum(c.strategy.endswith("[ulysses]")
                                         for c in sharded.plan.choices.values())
    errors = []
    for bad in (lambda: autotp.parallelize(models.llama(), tp=1, cp=world_size + 1,
                                           example_kwargs=model_inputs("llama", False)),
                lambda: sharded(**{k: v[:, :15] for k, v in inputs.items()})):
        try:
            bad()
            errors.append("no error")
        except autotp.AutotpError as exc:
            errors.append(str(exc))
    results["errors"] = errors
    return results



def fsdp_over_dp_and_cp(rank: int, world_size: int, steps: int = 2) -> dict[str, Any]:
    """dp 2 x cp 2 x tp (world_size / 4) on a (dp, cp, tp) DeviceMesh:
    ``autotp.parallelize(tp=..., cp=2)`` over the "tp" and "cp" dims and FSDP2 per layer and
    at the root over dp x cp (flattened) of each tp rank's pieces (the parameters are the
    same on every cp rank, so FSDP shards them over both, as over data-parallel replicas).
    Each dp rank takes half the batch (the second sequence of each half left-padded), each
    cp rank half of its sequence; AdamW steps after ``autotp.clip_grad_norm_`` to half the
    whole model's norm, against the unsharded model trained on the whole batch."""
    def build(model: torch.nn.Module, mesh: Any, mine: dict) -> Any:
        tp, cp = mesh["tp"].size(), mesh["cp"].size()
        groups = {"group": mesh["tp"], "cp_group": mesh["cp"]} if tp > 1 else \
            {"cp_group": mesh["cp"].get_group()}
        return autotp.parallelize(model, tp=tp, cp=cp, example_kwargs=mine, **groups)

    sharded, result = on_dp_cp_tp(world_size, steps, build)
    context = sharded.plan.on("cp")
    return {**result,
            "rings": sum(c.strategy.endswith("[ring]") for c in context.choices.values())}


def tp_inside_cp(rank: int, world_size: int, names: list[str], saved: Optional[str] = None
                 ) -> dict[str, Any]:
    """tp 2 x cp 2 on the world's 4 ranks: ``autotp.parallelize(model, tp=2, cp=2)`` of each
    model against the unsharded model (padded inputs), the first over the groups it makes
    itself (tp groups of consecutive ranks), the others over a (cp, tp) DeviceMesh's, GPT-2
    with sequence parallelism inside cp; ``saved``: a LLaMA saved there, loaded by
    ``autotp.from_pretrained(saved, 2, cp=2)`` against transformers' loading; then a tp x cp
    the world does not have."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests import models

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    results: dict[str, Any] = {}
    for i, name in enumerate(names):
        model = models.BUILDERS[name]().eval()
        inputs = model_inputs(name, name not in PLAIN)
        groups = {} if i == 0 else {"group": mesh["tp"], "cp_group": mesh["cp"]}
        sharded = autotp.parallelize(model, tp=2, cp=2, example_kwargs=inputs,
                                     sequence_parallel=name == "gpt2", **groups)
        call, loss, pick = _step_functions(name, inputs)
        results[name] = compare(reference_step(model, call, loss, pick),
                                sharded_step(sharded, call, loss, pick))
        results[f"{name}-ranks"] = (sharded.comm.rank, sharded.cp_comm.rank)
    if saved is not None:
        import transformers

        model = transformers.LlamaForCausalLM.from_pretrained(saved).eval()
        inputs = model_inputs("llama", True)
        sharded = autotp.from_pretrained(saved, 2, cp=2, example_kwargs=inputs)
        call, loss, pick = _step_functions("llama", inputs)
        results["pretrained"] = compare(reference_step(model, call, loss, pick),
                                        sharded_step(sharded, call, loss, pick))
    try:
        autotp.parallelize(models.llama(), tp=2, cp=3, example_kwargs=model_inputs("llama",
                                                                                  False))
        results["error"] = "no error"
    except autotp.AutotpError as exc:
        results["error"] = str(exc)
    return results


def four_ranks(rank: int, world_size: int, saved: str) -> dict[str, Any]:
    """The 4-process cases in one launch: FSDP2 over dp x cp, tp inside cp, pipeline stages
    over cp."""
    from tests.dist_cases import pipeline_context_case

    return {"fsdp": fsdp_over_dp_and_cp(rank, world_size),
            "tp_cp": tp_inside_cp(rank, world_size,
                                  ["llama", "gpt2", "nanogpt", "mistral_window",
                                   "x_transformers"], saved),
            "pp_cp": pipeline_context_case(rank, world_size)}


def eight_ranks(rank: int, world_size: int) -> dict[str, Any]:
    """The 8-process cases in one launch: FSDP2 over dp x cp with tp inside cp, then
    pipeline stages over cp with tp inside."""
    from tests.dist_cases import pipeline_context_case

    return {"fsdp": fsdp_over_dp_and_cp(rank, world_size),
            "pp_cp": pipeline_context_case(rank, world_size)}


def on_ranks(cp: int, work: Callable[[ThreadComm], Any]) -> list[Any]:
    """``work`` run by cp threads, one ThreadComm each: their results in rank order; the
    first error re-raised."""
    hub, out, errors = ThreadHub(cp, timeout=60), [None] * cp, []

    def run(rank: int) -> None:
        try:
            out[rank] = work(ThreadComm(hub, rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test
            errors.append(exc)
            hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def on_dp_cp_tp(world_size: int, steps: int, build: Callable[[Any, Any, dict], Any]
                ) -> tuple[Any, dict[str, Any]]:
    """A (dp, cp, tp) = (2, 2, world / 4) DeviceMesh; ``build(model, mesh, this dp rank's
    half of the batch)`` gives the sharded model, FSDP2 per layer and at the root over dp x cp
    (flattened); the second sequence of each half left-padded; AdamW steps after
    ``autotp.clip_grad_norm_`` against the unsharded model trained on the whole batch."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests import models
    from tests.dist_cases import train_against_reference

    torch.set_num_threads(1)
    dp, cp, tp = 2, 2, world_size // 4
    mesh = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    both = mesh["dp", "cp"]._flatten("dp_cp")
    model = models.llama().train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, models.VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1::2, :3] = 0
    half = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)
    mine = {"input_ids": ids[half], "attention_mask": mask[half], "labels": ids[half]}
    sharded = build(model, mesh, mine)
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=both)
    fully_shard(sharded, mesh=both)
    whole = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    return sharded, train_against_reference(sharded, reference, mine, whole, steps,
                                            mesh["dp"].get_group(), dp)
