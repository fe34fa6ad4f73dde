"""Checkpoint cases run inside real worker processes (``autotp.runtime.launch.run_processes``).

The models here have every weight perturbed at random (biases and norm scales too), so a
slice read from the wrong place, a bias added twice or a norm scale sliced cannot cancel out.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from autotp.verification.verify import max_difference, perturb
from tests.models import VOCAB, gpt2_config, llama_config
from tests.models import quiet_transformers as _tf


def gpt2() -> Any:
    """Tied embedding and head, Conv1D weights stored [in, out], fused q|k|v (c_attn)."""
    return _tf().GPT2LMHeadModel(gpt2_config())


def llama() -> Any:
    """GQA with 2 k/v heads: at tp = 4 the k/v projections are replicated."""
    return _tf().LlamaForCausalLM(llama_config(bos_token_id=0, eos_token_id=0,
                                               pad_token_id=0))


def phi3(kv_heads: int = 8) -> Any:
    """Fused nn.Linear projections: qkv_proj (q|k|v) and gate_up_proj (gate|up)."""
    tf = _tf()
    return tf.Phi3ForCausalLM(tf.Phi3Config(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=8,
        num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
        attention_dropout=0.0))


def phi3_gqa() -> Any:
    """Phi-3 with 4 k/v heads for 8 query heads: qkv_proj is q|k|v in proportions 2:1:1,
    sharded per part (S(0)x2:1:1) at tp = 2 and 4, and stored whole by save_checkpoint."""
    return phi3(kv_heads=4)


def bigcode() -> Any:
    """Multi-query attention fused with q: c_attn is 64 q rows, then one 8-row k and v head,
    sharded as S(0)x8:1*:1* (k and v whole on every rank, their gradients summed)."""
    tf = _tf()
    return tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(
        n_layer=2, n_embd=64, n_head=8, multi_query=True, vocab_size=VOCAB, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=False))


def qwen3_moe() -> Any:
    """4 experts stacked per layer (transformers writes them per expert): whole experts per
    rank, each rank reading only its own experts' tensors."""
    tf = _tf()
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=8,
        num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
        pad_token_id=0))


BUILDERS: dict[str, Callable[[], Any]] = {"gpt2": gpt2, "llama": llama, "phi3": phi3,
                                          "phi3_gqa": phi3_gqa, "bigcode": bigcode,
                                          "qwen3_moe": qwen3_moe}
MQA = "transformer.h.0.attn.c_attn.weight"  # GPTBigCode's fused q|k|v, one k/v head
QKV = "model.layers.0.self_attn.qkv_proj.weight"  # Phi-3's fused q|k|v


def save_hf(name: str, directory: str, seed: int = 0, max_shard_size: str = "40KB",
            dtype: torch.dtype = torch.float32) -> None:
    """A transformers model with perturbed weights, saved by transformers in several files."""
    torch.manual_seed(seed)
    model = perturb(BUILDERS[name](), seed=seed + 1, std=0.05).to(dtype)
    model.save_pretrained(directory, max_shard_size=max_shard_size)


def batch(seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (2, 12), generator=generator)


def _step(module: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    module.zero_grad(set_to_none=True)
    out = module(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), float(out.loss.detach())


def load_cases(rank: int, world_size: int, directories: list[str]) -> list[dict[str, Any]]:
    """``load_case`` for several checkpoints in one set of processes."""
    return [load_case(rank, world_size, d) for d in directories]


def load_case(rank: int, world_size: int, directory: str, dtype: str = "float32",
              sequence_parallel: bool = False) -> dict[str, Any]:
    """from_pretrained at tp = world_size against transformers' own unsharded load. Every
    rank is seeded differently: weights come from the file, the dropout seed is agreed."""
    import autotp

    tf = _tf()
    torch.set_num_threads(1)
    torch.manual_seed(1000 + rank)
    ids = batch()
    example = {"input_ids": ids, "labels": ids}
    with counting_reads() as read:
        sharded = autotp.from_pretrained(directory, tp=world_size,
                                         dtype=getattr(torch, dtype), example_kwargs=example,
                                         training=True, sequence_parallel=sequence_parallel)
    reference = tf.AutoModelForCausalLM.from_pretrained(directory,
                                                        dtype=getattr(torch, dtype))
    reference.train()
    logits, loss = _step(sharded, ids)
    ref_logits, ref_loss = _step(reference, ids)
    grads = autotp.full_state_dict(sharded, grads=True)
    weights = autotp.full_state_dict(sharded)
    ref_state = reference.state_dict()
    grad_diff = max_difference({n: p.grad for n, p in reference.named_parameters()}, grads)
    weight_diff = max_difference(weights, ref_state)
    local = sum(p.numel() for p in sharded.parameters())
    qkv = next((t for t, p in sharded.plan.params.items() if QKV in p.names), None)
    return {"logits": max_difference(ref_logits, logits), "loss": abs(loss - ref_loss),
            "grad": grad_diff, "weights": weight_diff, "dtype": str(logits.dtype),
            "sequence_parallel": sharded.plan.sequence_parallel,
            "local_params": local,
            "full_params": sum(p.numel() for p in reference.parameters()),
            "bytes_read": sum(read.values()),
            "param_bytes": sum(p.numel() * p.element_size() for p in sharded.parameters()),
            "qkv_layout": None if qkv is None else str(sharded.plan.param_layout(qkv)),
            "mqa_layout": sharded.plan.params[MQA].layout if MQA in sharded.plan.params
            else None,
            "qkv_read": read.get(QKV, 0),
            "qkv_bytes": ref_state[QKV].numel() * ref_state[QKV].element_size()
            if QKV in ref_state else 0}


@contextlib.contextmanager
def counting_reads() -> Iterator[dict[str, int]]:
    """Bytes of each checkpoint tensor that autotp asks its files for, by key: a slice
    counts its own bytes (whatever the file reader fetches around short runs)."""
    from autotp.weights.tensorfile import TensorFiles

    read: dict[str, int] = {}
    plain, ranged = TensorFiles.read, TensorFiles.read_range

    def count(name: str, tensor: torch.Tensor) -> torch.Tensor:
        read[name] = read.get(name, 0) + tensor.numel() * tensor.element_size()
        return tensor

    TensorFiles.read = lambda self, name: count(name, plain(self, name))  # type: ignore
    TensorFiles.read_range = lambda self, name, *a: count(  # type: ignore
        name, ranged(self, name, *a))
    try:
        yield read
    finally:
        TensorFiles.read, TensorFiles.read_range = plain, ranged  # type: ignore


def save_case(rank: int, world_size: int, source: str, target: str) -> int:
    """from_pretrained at tp = world_size, then save_pretrained in several small files."""
    import autotp

    torch.set_num_threads(1)
    sharded = autotp.from_pretrained(source, tp=world_size)
    autotp.save_pretrained(sharded, target, max_shard_size="30KB")
    return rank


# ---- resuming at another tp -----------------------------------------------------------

LR = 1e-2


def batches(count: int, start: int = 0) -> list[torch.Tensor]:
    return [batch(seed=100 + i) for i in range(start, start + count)]


def _train(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
           steps: list[torch.Tensor], scheduler: Any = None) -> list[float]:
    losses = []
    for ids in steps:
        optimizer.zero_grad(set_to_none=True)
        out = module(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(float(out.loss.detach()))
    return losses


class Reference:
    """Uninterrupted unsharded training: transformers' model, AdamW, the same batches.
    ``settings``: AdamW's (default: lr=LR, the rest AdamW's defaults); ``groups``: the
    param groups made of the parameters."""

    def __init__(self, source: str, settings: dict[str, Any] | None = None,
                 groups: Callable[[Any], Any] = list):
        tf = _tf()
        torch.manual_seed(0)
        self.model = tf.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(groups(self.model.parameters()),
                                           **(settings or {"lr": LR}))
        self.done = 0

    def train(self, steps: int, scheduler: Any = None) -> list[float]:
        losses = _train(self.model, self.optimizer, batches(steps, self.done), scheduler)
        self.done += steps
        return losses

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of the weights as ``model.<name>``, and of AdamW's state as
        ``optim.<name>.<key>`` (as save_checkpoint names them)."""
        out = {f"model.{n}": p.detach().clone() for n, p in self.model.named_parameters()}
        for name, param in self.model.named_parameters():
            for key, value in self.optimizer.state.get(param, {}).items():
                out[f"optim.{name}.{key}"] = value.clone()
        return out


def stored_whole(directory: str) -> dict[str, torch.Tensor]:
    """The tensors a save_checkpoint directory holds whole (``model.<name>``,
    ``optim.<name>.<key>``), read straight from its files: those of the global shape that
    its autotp.json records (every tensor of a tp = 1 checkpoint; otherwise the replicated
    ones and those blocked into unequal segments), and the 0-d step counts."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    shapes = {name: v["global_shape"]
              for name, v in json.loads((Path(directory) / "autotp.json").read_text())
              ["params"].items()}
    out = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), "pt") as stored:
            for key in stored.keys():
                kind, _, rest = key.partition(".")
                name = rest if kind == "model" else rest.rpartition(".")[0]
                tensor = stored.get_tensor(key)
                if list(tensor.shape) == shapes[name] or (kind == "optim" and
                                                          tensor.dim() == 0):
                    out[key] = tensor
    return out


def resume_case(rank: int, world_size: int, source: str, load: str | None, save: str,
                start: int, steps: int, export: str | None = None) -> dict[str, Any]:
    """Weights from ``source``; state (weights and AdamW) from ``load`` when given; train
    ``steps`` batches from batch ``start``; save_checkpoint to ``save``; with ``export``,
    also save_pretrained there, and (rank 0) load it back with transformers: its largest
    difference from the trained weights, and whether it holds the same names."""
    import autotp

    tf = _tf()
    torch.set_num_threads(1)
    ids = batch()
    sharded = autotp.from_pretrained(source, tp=world_size, training=True,
                                     example_kwargs={"input_ids": ids, "labels": ids})
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=LR)
    if load is not None:
        autotp.load_checkpoint(sharded, load, optimizer=optimizer)
    out: dict[str, Any] = {"losses": _train(sharded, optimizer, batches(steps, start))}
    autotp.save_checkpoint(sharded, save, optimizer=optimizer)
    if export is not None:
        autotp.save_pretrained(sharded, export, max_shard_size="30KB")
        trained = autotp.full_state_dict(sharded)
        if rank == 0:
            again = tf.AutoModelForCausalLM.from_pretrained(export).state_dict()
            out["export_names"] = set(again) == set(trained)
            out["export"] = max_difference(trained, again)
    return out


# AdamW settings none of which is the default, the vectors (norm scales) in a group of their
# own without weight decay, and a schedule that halves lr every step: the settings a
# checkpoint holds are not those of the optimizer built to load it
SETTINGS: dict[str, Any] = {"lr": LR, "betas": (0.8, 0.95), "weight_decay": 0.1}
VECTORS: dict[str, Any] = {"lr": 2 * LR, "weight_decay": 0.0}
DECAY = 0.5
GATE_UP = "model.layers.0.mlp.gate_up_proj.weight"  # Phi-3's fused gate|up


def param_groups(params: Iterator[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """Matrices, then vectors: two groups (``VECTORS`` apart from ``SETTINGS``)."""
    params = list(params)
    return [{"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], **VECTORS}]


def schedule(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=DECAY)


def upward_case(rank: int, world_size: int, source: str, load: str | None, save: str | None,
                start: int, steps: int, expected: str | None) -> dict[str, Any]:
    """Without ``load``: AdamW over ``param_groups`` with ``SETTINGS`` and ``schedule``. With
    ``load``: a fresh AdamW over the same groups at its defaults (lr=LR) loads the
    checkpoint; then every parameter, AdamW moment
    and step count this rank holds is compared with its slice of ``expected`` (the unsharded
    reference's state, a safetensors file) before any step, and the param groups' settings
    are reported. Then ``steps`` batches from ``start`` (no schedule after a load) and, with
    ``save``, save_checkpoint."""
    import autotp
    from autotp.layout import Shard, shard_tensor

    torch.set_num_threads(1)
    ids = batch()
    sharded = autotp.from_pretrained(source, tp=world_size, training=True,
                                     example_kwargs={"input_ids": ids, "labels": ids})
    out: dict[str, Any] = {}
    scheduler = None
    if load is None:
        optimizer = torch.optim.AdamW(param_groups(sharded.parameters()), **SETTINGS)
        scheduler = schedule(optimizer)
    else:
        optimizer = torch.optim.AdamW(param_groups(sharded.parameters()), lr=LR)
        autotp.load_checkpoint(sharded, load, optimizer=optimizer)
        out["groups"] = [{k: group[k] for k in ("lr", "betas", "weight_decay")}
                         for group in optimizer.param_groups]
    if expected is not None:
        from safetensors.torch import load_file

        want = load_file(expected)
        plan = sharded.plan
        worst: dict[str, float] = {}
        for target, local in sharded.local_parameters().items():
            name, layout = plan.params[target].names[0], plan.param_layout(target)
            out.setdefault("layouts", {})[name] = str(layout)
            pieces = {f"model.{name}": local.detach(),
                      **{f"optim.{name}.{k}": v for k, v in optimizer.state[local].items()}}
            for key, got in pieces.items():
                full = want[key]
                if isinstance(layout, Shard) and full.dim() > 0:
                    full = shard_tensor(full, layout, rank, world_size)
                worst[key] = max_difference(full, got, relative=True)
        out["slices"] = worst
    out["losses"] = _train(sharded, optimizer, batches(steps, start), scheduler)
    if save is not None:
        autotp.save_checkpoint(sharded, save, optimizer=optimizer)
    return out


def _train_data_parallel(sharded: Any, optimizer: torch.optim.Optimizer,
                         steps: list[torch.Tensor]) -> list[float]:
    """``_train`` with the experts split over ep data-parallel ranks: each ep rank on its
    share of every batch, the dense gradients averaged over the ep ranks, the experts'
    finished by ``finish_expert_gradients``; the losses are the ep ranks' mean."""
    ep = sharded.plan.ep
    experts = {id(p) for p in sharded.expert_parameters().values()}
    losses = []
    for ids in steps:
        part = ids.chunk(ep)[sharded.ep_comm.rank if ep > 1 else 0]
        optimizer.zero_grad(set_to_none=True)
        loss = sharded(input_ids=part, labels=part).loss
        loss.backward()
        if ep > 1:
            for param in sharded.parameters():
                if id(param) not in experts:
                    param.grad = sharded.ep_comm.all_reduce(param.grad) / ep
            sharded.finish_expert_gradients()
            loss = sharded.ep_comm.all_reduce(loss.detach()) / ep
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def expert_resume_case(rank: int, world_size: int, source: str,
                       stages: list[tuple[int, int, str | None, int, str | None]], weights: str,
                       more: int = 0) -> list[float]:
    """Per stage (tp, ep, load, steps, save): from_pretrained at tp x ep (the experts split
    over both), AdamW's state loaded from ``load`` when given, ``steps`` batches trained
    data-parallel over the ep ranks (after those of the checkpoint), save_checkpoint to
    ``save`` when given; then ``more`` batches without a break. The losses; rank 0 writes
    the weights, whole, to the safetensors file ``weights``."""
    import autotp
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    losses: list[float] = []
    for tp, ep, load, steps, save in stages:
        ids = batch()[:2 // ep]
        sharded = autotp.from_pretrained(source, tp=tp, ep=ep, training=True,
                                         example_kwargs={"input_ids": ids, "labels": ids})
        optimizer = torch.optim.AdamW(sharded.parameters(), lr=LR)
        start = 0
        if load is not None:
            autotp.load_checkpoint(sharded, load, optimizer=optimizer)
            start = int(next(iter(optimizer.state.values()))["step"])
        losses += _train_data_parallel(sharded, optimizer, batches(steps, start))
        if save is not None:
            autotp.save_checkpoint(sharded, save, optimizer=optimizer)
    losses += _train_data_parallel(sharded, optimizer, batches(more, start + steps))
    whole = autotp.full_state_dict(sharded)
    if rank == 0:
        save_file({n: t.clone() for n, t in whole.items()}, weights)
    return losses


# ---- memory ---------------------------------------------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Start a new peak-RSS window (VmHWM := VmRSS)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


MEMORY_SLACK = 48 * 2**20  # graphs, plans and allocator slack of one load


def save_big(directory: str) -> None:
    """A LLaMA of ~110M parameters (bf16, ~220 MB in several files): weights dominate."""
    tf = _tf()
    config = tf.LlamaConfig(num_hidden_layers=8, hidden_size=1024, intermediate_size=2816,
                            num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
                            max_position_embeddings=256)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.02 * torch.randn(param.shape, generator=generator))
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="30MB")


def memory_case(rank: int, world_size: int, directory: str, naive: bool = False
                ) -> dict[str, int]:
    """Peak resident-memory growth of one rank while it loads ``directory``: autotp's
    slice reads, or (``naive``) transformers' full load followed by parallelize."""
    import gc

    import autotp
    import autotp.weights.tensorfile

    tf = _tf()
    torch.set_num_threads(1)
    ids = batch()
    with torch.device("meta"):  # imports and first-call caches, without any weights
        autotp.plan(tf.AutoModelForCausalLM.from_config(
            tf.AutoConfig.from_pretrained(directory)), world_size,
            example_kwargs={"input_ids": ids})
    gc.collect()
    read = [0]
    pread_into = autotp.weights.tensorfile.SafetensorsFile._pread_into

    def counting(self: Any, view: memoryview, offset: int) -> None:
        read[0] += len(view)
        pread_into(self, view, offset)

    autotp.weights.tensorfile.SafetensorsFile._pread_into = counting  # type: ignore[method-assign]
    reset_peak()
    before = _status("VmRSS")
    if naive:
        model = tf.AutoModelForCausalLM.from_pretrained(directory)
        sharded = autotp.parallelize(model, tp=world_size)
    else:
        sharded = autotp.from_pretrained(directory, tp=world_size)
    peak = _status("VmHWM")
    local = sum(t.numel() * t.element_size()
                for t in [*sharded.parameters(), *sharded.buffers()])
    params = sum(t.numel() * t.element_size() for t in sharded.parameters())
    return {"growth": peak - before, "local_bytes": local, "param_bytes": params,
            "bytes_read": read[0]}


# ---- init=True ------------------------------------------------------------------------


class Block(torch.nn.Module):
    """Plain torch modules only: construction is reset_parameters() in module order."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 64, heads: int = 8, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * (1 + self.scale)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def init_case(rank: int, world_size: int, kind: str) -> dict[str, float]:
    """init=True on a model without weights against the unsharded model initialized the
    same way with the same seed; max |difference| over every parameter."""
    import autotp

    _tf()
    torch.set_num_threads(1)
    ids = batch()
    if kind == "tiny":
        torch.manual_seed(7)
        reference = TinyLM()  # construction runs reset_parameters() module by module
        with autotp.empty_weights():
            model = TinyLM()
        torch.manual_seed(7)
        sharded = autotp.parallelize(model, tp=world_size, example_args=(ids,), init=True)
    else:
        with torch.device("meta"):
            model = gpt2()
        torch.manual_seed(7)
        sharded = autotp.parallelize(model, tp=world_size, init=True,
                                     example_kwargs={"input_ids": ids})
        with torch.device("meta"):
            reference = gpt2()
        reference.to_empty(device="cpu")
        reference.tie_weights()
        torch.manual_seed(7)
        with torch.no_grad():
            reference.apply(reference._init_weights)  # transformers' post-order init
    full = autotp.full_state_dict(sharded)
    state = reference.state_dict()
    diff = max_difference(full, state)
    out = sharded(ids) if kind == "tiny" else sharded(input_ids=ids).logits
    ref_out = reference(ids) if kind == "tiny" else reference(input_ids=ids).logits
    return {"params": diff, "names": float(len(full)), "expected": float(len(state)),
            "output": max_difference(ref_out, out)}


# ---- errors ---------------------------------------------------------------------------


def error_case(rank: int, world_size: int, directory: str, other: str) -> dict[str, str]:
    """Each bad input's error message (or 'no error')."""
    import json
    from pathlib import Path

    import autotp
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(1)
    base = Path(directory)
    work = Path(other)
    out: dict[str, str] = {}

    def attempt(label: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            out[label] = "no error"
        except autotp.AutotpError as exc:
            out[label] = f"AutotpError: {exc}"
        except Exception as exc:  # noqa: BLE001 - reported as the wrong kind of error
            out[label] = f"{type(exc).__name__}: {exc}"

    attempt("no such path", lambda: autotp.from_pretrained(work / "nope", tp=world_size))
    pickled = work / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((base / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    attempt("pickled weights", lambda: autotp.from_pretrained(pickled, tp=world_size))
    with torch.device("meta"):
        model = llama()
    attempt("bin file", lambda: autotp.parallelize(model, tp=world_size,
                                                   checkpoint=pickled / "pytorch_model.bin"))
    attempt("meta without weights", lambda: autotp.parallelize(model, tp=world_size))
    files = sorted(base.glob("*.safetensors"))
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
    (work / "config.json").write_text((base / "config.json").read_text())

    def variant(name: str, changed: dict[str, torch.Tensor]) -> Path:
        folder = work / name
        folder.mkdir()
        (folder / "config.json").write_text((base / "config.json").read_text())
        save_file(changed, folder / "model.safetensors", metadata={"format": "pt"})
        return folder

    missing = dict(tensors)
    del missing["model.layers.1.mlp.down_proj.weight"]
    attempt("missing key", lambda: autotp.from_pretrained(variant("missing", missing),
                                                          tp=world_size))
    extra = {**tensors, "model.layers.1.mlp.extra.weight": torch.zeros(2)}
    attempt("unexpected key", lambda: autotp.from_pretrained(variant("extra", extra),
                                                             tp=world_size))
    wrong = {**tensors, "model.layers.0.mlp.up_proj.weight": torch.zeros(96, 64)}
    attempt("wrong shape", lambda: autotp.from_pretrained(variant("shape", wrong),
                                                          tp=world_size))
    truncated = variant("truncated", tensors)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    attempt("truncated file", lambda: autotp.from_pretrained(truncated, tp=world_size))
    sharded = autotp.from_pretrained(base, tp=world_size)
    attempt("not a checkpoint", lambda: autotp.load_checkpoint(sharded, base))
    gpt = work / "gpt2"
    save_hf("gpt2", str(gpt), max_shard_size="5GB")
    other_model = autotp.from_pretrained(gpt, tp=world_size)
    autotp.save_checkpoint(other_model, work / "gpt2-ckpt")
    attempt("another model's checkpoint",
            lambda: autotp.load_checkpoint(sharded, work / "gpt2-ckpt"))
    json.dumps(out)
    return out


def generation_config_case(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """from_pretrained, then generate() with no length: the checkpoint's
    generation_config.json (max_new_tokens, pad token) decides, as for transformers' load."""
    import autotp

    tf = _tf()
    torch.set_num_threads(1)
    ids = batch()[:, :5]
    sharded = autotp.from_pretrained(directory, tp=world_size)
    reference = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return {"sharded": sharded.generate(ids, do_sample=False).tolist(),
            "reference": reference.generate(ids, do_sample=False).tolist()}
