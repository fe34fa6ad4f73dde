"""transformers' Trainer on a sharded model and on the unsharded one, in gloo processes
(``autotp.runtime.launch.run_processes``): each case returns the per-step losses Trainer
logged and the whole final weights, for the test to compare."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist

import autotp
from tests.models import VOCAB, gpt2

STEPS = 4
BATCH = 2  # per data-parallel rank
LR = 1e-3


def _environment(rank: int, world: int) -> None:
    """What accelerate reads to see the process group torchrun would have described."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29555")})


class Tokens(torch.utils.data.Dataset):
    """Fixed random sequences; the labels are the inputs (causal LM loss), some masked."""

    def __init__(self, count: int = 32, length: int = 16):
        generator = torch.Generator().manual_seed(123)
        self.ids = torch.randint(0, VOCAB, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.ids[index]
        labels = ids.clone()
        labels[: index % 4] = -100  # a varying number of counted tokens per row
        return {"input_ids": ids, "labels": labels}


def _train(model: torch.nn.Module, **overrides: Any) -> tuple[list[float], Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), use_cpu=True, seed=0,
        per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
        learning_rate=LR, max_steps=STEPS, logging_steps=1, save_strategy="no",
        report_to=[], disable_tqdm=True, **overrides)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   eval_dataset=Tokens(8))
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    norms = [row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row]
    evaluation = trainer.evaluate()["eval_loss"]
    return losses + norms + [evaluation], trainer


def _sent(weights: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Tensors as lists: a worker's shared-memory tensors may not outlive it on the queue."""
    return {k: v.detach().double().flatten().tolist() for k, v in weights.items()}


def reference_case(rank: int, world: int, accumulate: int = 1) -> dict[str, Any]:
    """Trainer on the unsharded model (DDP over the ``world`` processes when more than
    one), accumulating gradients over ``accumulate`` batches."""
    _environment(rank, world)
    model = gpt2()
    numbers, _ = _train(model, gradient_accumulation_steps=accumulate)
    return {"numbers": numbers, "weights": _sent(dict(model.named_parameters()))}


def sharded_case(rank: int, world: int, tp: int, accumulate: int = 1) -> dict[str, Any]:
    """Trainer on ``autotp.parallelize`` at ``tp`` over a ("dp", "tp") mesh of the world,
    with nothing autotp-specific besides the call."""
    from torch.distributed.device_mesh import init_device_mesh

    _environment(rank, world)
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    model = gpt2()
    example = Tokens()[0]
    sharded = autotp.parallelize(model, tp=tp, group=mesh["tp"],
                                 example_kwargs={"input_ids": example["input_ids"][None]})
    numbers, _ = _train(sharded, gradient_accumulation_steps=accumulate)
    weights = autotp.full_state_dict(sharded)
    return {"numbers": numbers, "weights": _sent(weights),
            "names": sorted(n for n, _ in sharded.named_parameters()),
            "model_names": sorted(n for n, _ in model.named_parameters())}


def ddp_over_peers_case(rank: int, world: int) -> str:
    """DDP over the whole world wrapped around a tp-2 module: refused at the first step."""
    model = gpt2()
    ids = Tokens()[0]["input_ids"][None]
    sharded = autotp.parallelize(model, tp=world, example_kwargs={"input_ids": ids})
    before = {n: p.detach().clone() for n, p in sharded.named_parameters()}
    wrapped = torch.nn.parallel.DistributedDataParallel(sharded)
    try:
        wrapped(input_ids=ids)
    except autotp.ConfigError as exc:
        return str(exc)
    finally:
        del before
    return "not refused"


def ddp_over_dp_case(rank: int, world: int) -> float:
    """DDP over the data-parallel axis of a (dp 2, tp 2) mesh trains as the unsharded model
    under DDP over two ranks: returns the largest weight difference after two steps."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    data = Tokens().ids
    dp = mesh["dp"].get_local_rank()
    mine = data[dp * BATCH:(dp + 1) * BATCH]
    model = gpt2()
    reference = gpt2()
    sharded = autotp.parallelize(model, tp=2, group=mesh["tp"],
                                 example_kwargs={"input_ids": mine})
    wrapped = torch.nn.parallel.DistributedDataParallel(
        sharded, process_group=mesh["dp"].get_group())
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        wrapped(input_ids=mine, labels=mine).loss.backward()
        opt.step()
        opt.zero_grad()
        both = data[:2 * BATCH]  # the unsharded model sees both dp ranks' rows: their mean
        reference(input_ids=both, labels=both).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    whole = autotp.full_state_dict(sharded)
    dist.barrier()
    return max((whole[n] - p.detach()).abs().max().item()
               for n, p in reference.named_parameters())


def fsdp_over_peers_case(rank: int, world: int) -> str:
    """FSDP2 over the whole world around a tp-2 module: refused at the first forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ids = Tokens()[0]["input_ids"][None]
    sharded = autotp.parallelize(gpt2(), tp=world, example_kwargs={"input_ids": ids})
    fully_shard(sharded, mesh=init_device_mesh("cpu", (world,)))
    try:
        sharded(input_ids=ids)
    except autotp.ConfigError as exc:
        return str(exc)
    return "not refused"


class PlainLM(torch.nn.Module):
    """A language model of no library: a dict with the loss when given labels. No bias on
    q|k|v: a key bias's gradient is zero in exact arithmetic (softmax ignores a constant per
    row), and AdamW would turn its rounding, which differs between any two ways of summing,
    into steps of the learning rate's size."""

    def __init__(self, width: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
        self.out = torch.nn.Linear(width, width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: Any = None) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for y in self.qkv(x).chunk(3, -1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, c))
        x = x + self.down(torch.nn.functional.gelu(self.up(x)))
        logits = self.head(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return out


def plain_case(rank: int, world: int, tp: int) -> dict[str, Any]:
    """Trainer on a model of no library: the reference when ``tp`` is 0, else sharded."""
    _environment(rank, world)
    torch.manual_seed(0)
    model = PlainLM()
    if tp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        sharded = autotp.parallelize(model, tp=tp, group=mesh["tp"],
                                     example_kwargs={"input_ids": Tokens().ids[:2]})
        numbers, _ = _train(sharded)
        return {"numbers": numbers, "weights": _sent(autotp.full_state_dict(sharded))}
    numbers, _ = _train(model)
    return {"numbers": numbers, "weights": _sent(dict(model.named_parameters()))}
