"""``autotp estimate`` against published measurements: predicted beside published.

    python -m benchmarks.estimate_published [--only activations,megatron,llama70b,context,gpu]

1. activations: activation memory per layer of a Megatron-style GPT (pre-LayerNorm, fused
   qkv, eager softmax attention with dropout on the probabilities, 4h GELU MLP, dropouts;
   examples/nanogpt.py with flash=False) at h 2048, 16 heads, s 256, b 4, 16-bit, no
   recomputation: the difference between a 4- and a 2-layer model, halved, against Korthikanti
   et al. 2022 (Table 2): tp 1 sbh(34 + 5as/h), tp t sbh(10 + 24/t + 5as/(ht)), tp t with
   sequence parallelism sbh/t (34 + 5as/h), at t = 8.
2. megatron: Megatron-LM (Shoeybi et al. 2019) on a DGX-2H (V100), fp16, activation
   checkpointing, batch 8, sequence 1024: the strong scaling of the 1.2B GPT-2 (h 1536,
   16 heads, 40 layers, vocabulary 51200) at tp 2/4/8 (published speedups 1.64/2.34/2.98),
   and the 8.3B (h 3072, 32 heads, 72 layers) at tp 8 at 77 % of the 1.2B's per-GPU FLOP
   rate on one GPU; then where the 1.2B's step goes at tp 1 and tp 8 (what tensor
   parallelism divides, what it leaves replicated, the collectives' latency and bytes).
3. llama70b: a LLaMA-2-70B shape on 64 A100-80GB (8 per node), global batch 512 x 4096
   tokens, bf16: the whole search on the meta device, its time, the best configuration and
   its MFU (published Megatron runs of this size sit near 50 %), and why the others are out.
4. context: a LLaMA-3-8B shape on 32 H100 (4 nodes of 8), global batch 8 sequences of
   524,288 tokens: the search over tp x cp x pp x dp, the best configuration beside the best
   without context parallelism (none fits: a sequence's activations and logits alone
   outgrow a GPU), and the same model at 8,192 tokens, where the best keeps the sequence
   whole and the table says what cp would cost.
5. gpu (only where CUDA is present): LLaMA shapes at tp 1 trained on this GPU (bfloat16,
   fused AdamW): the forward and backward time, the optimizer step, the model states, what
   the forward leaves for backward and the peak, each predicted beside measured.

Every model is built on the meta device (no weights); nothing here needs a GPU but step 5.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks.harness import Stopwatch, time_round_robin



def _quiet() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def activations() -> None:
    from examples import nanogpt as nano

    from autotp.capture.trace import capture
    from autotp.planner.job.memory import layer_activations
    from autotp.planner.job.profile import build_profile
    from autotp.planner.solve import PlanOptions, plan_graph

    h, a, s, b, t = 2048, 16, 256, 4, 8

    def saved(layers: int, tp: int, sp: bool) -> float:
        with torch.device("meta"):
            model = nano.GPT(nano.GPTConfig(n_layer=layers, n_head=a, n_embd=h, vocab_size=512,
                                            block_size=s, dropout=0.1, flash=False))
        model.train()
        captured = capture(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),), {})
        plan = plan_graph(captured, tp, options=PlanOptions(sequence_parallel=sp))
        prof = build_profile(captured, plan, b, s, dtype_bytes=2, mask_bytes=1)
        return sum(layer_activations(prof, "none").values())

    sbh = s * b * h
    rows = [("tp 1", 1, False, sbh * (34 + 5 * a * s / h)),
            (f"tp {t}", t, False, sbh * (10 + 24 / t + 5 * a * s / (h * t))),
            (f"tp {t} + SP", t, True, sbh / t * (34 + 5 * a * s / h))]
    print(f"1. activation memory per layer, Megatron-style GPT h={h} a={a} s={s} b={b}, "
          "16-bit, no recomputation")
    print(f"   {'':<10} {'autotp estimate':>16} {'Korthikanti':>12} {'ratio':>7}")
    for label, tp, sp, published in rows:
        got = (saved(4, tp, sp) - saved(2, tp, sp)) / 2
        print(f"   {label:<10} {got / 2**20:>12.2f} MiB {published / 2**20:>8.2f} MiB "
              f"{got / published:>7.3f}")


def _gpt2(h: int, heads: int, layers: int) -> torch.nn.Module:
    transformers = _quiet()
    # Megatron-LM (2019, mpu/transformer.py) runs its tanh GELU as one TorchScript-fused
    # kernel: GPT-2's "gelu_new" would trace as eight elementwise kernels over the 4h
    # activation, "gelu_pytorch_tanh" is the same function in one
    config = transformers.GPT2Config(n_embd=h, n_head=heads, n_layer=layers, vocab_size=51200,
                                     n_positions=1024, activation_function="gelu_pytorch_tanh")
    config._attn_implementation = "eager"  # Megatron-LM's unfused softmax attention
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config)


def _planner(model: torch.nn.Module, name: str, seq: int, dtype: str = "bfloat16") -> Any:
    from autotp.planner.job.configure import (
        Planner,
        attention_heads,
        capture_for_training,
        training_example,
    )

    profiled, planned = capture_for_training(model, None, training_example(model), dtype)
    return Planner(profiled, name, seq, attention_heads(model), planned)


def megatron() -> None:
    from autotp.planner.job.configure import Request, search
    from autotp.planner.job.hardware import PRESETS

    hw = PRESETS["v100"]

    def run(planner: Any, tp: int) -> Any:
        req = Request(gpus=tp, global_batch=8, seq=1024, mesh=(1, 1, tp), micro_batch=8,
                      checkpointing="full", sequence_parallel=False, dtype="float16",
                      precision="fp16-mixed", dp_shard="none")
        return search(planner, hw, req)[0]

    small = _planner(_gpt2(1536, 16, 40), "gpt2-1.2B", 1024, "float16")
    results = {tp: run(small, tp) for tp in (1, 2, 4, 8)}
    print("2. Megatron-LM 2019, DGX-2H V100, fp16, full recomputation, batch 8 x 1024")
    print(f"   1.2B on 1 GPU: {results[1].time.step:.3f} s per step predicted, "
          f"{results[1].mfu * hw.peak('float16') / 1e12:.1f} TFLOP/s of model FLOPs")
    print(f"   {'tp':>4} {'step s':>8} {'compute':>8} {'tp comm':>8} {'speedup':>8} "
          f"{'published':>9} {'ratio':>6}")
    published = {2: 1.64, 4: 2.34, 8: 2.98}
    for tp in (2, 4, 8):
        c = results[tp]
        speedup = results[1].time.step / c.time.step
        print(f"   {tp:>4} {c.time.step:>8.3f} {c.time.compute:>8.3f} {c.time.tp_comm:>8.3f} "
              f"{speedup:>8.2f} {published[tp]:>9.2f} {speedup / published[tp]:>6.2f}")
    print("   where the step goes (s; forward, recomputed forward and backward; fixed: the "
          "per-kernel launch cost inside the rows above)")
    one, eight = small.profile(1, False, 8, 2), small.profile(8, False, 8, 2)
    # an elementwise kernel moving as many bytes at tp 8 as on one GPU is replicated work
    alone = {op.name: op.nbytes for op in one.ops}
    replicated = {op.name for op in eight.ops if op.kind == "memory" and not op.quadratic
                  and alone.get(op.name) == op.nbytes}
    where = {tp: _where(prof, replicated, hw) for tp, prof in ((1, one), (8, eight))}
    for key in where[8]:
        a, b = where[1].get(key, 0.0), where[8][key]
        print(f"   {key:<44} tp 1 {a:>7.3f}  tp 8 {b:>7.3f}" +
              (f"  ({a / b:.1f}x less)" if a and b else ""))
    big = run(_planner(_gpt2(3072, 32, 72), "gpt2-8.3B", 1024, "float16"), 8)
    ratio = big.mfu / results[1].mfu
    print(f"   8.3B at tp 8: {big.time.step:.3f} s per step, per-GPU FLOP rate "
          f"{ratio:.0%} of the 1.2B's on one GPU (published 77 %)")


def _where(prof: Any, replicated: set[str], hw: Any) -> dict[str, float]:
    """One micro-batch's seconds by kind of work under full recomputation: what tensor
    parallelism divides and what it leaves (the ops named in ``replicated``), and the
    collectives' latency against their bandwidth."""
    from autotp.planner.job.timing import BACKWARD, _op_time, collective_time, ring_steps

    keys = ("weight GEMMs", "attention core (scores, softmax, dropout)",
            "elementwise sharded", "elementwise replicated on every rank",
            "  fixed per-kernel cost of the above",
            "collectives: latency (launch + ring steps)",
            "collectives: bytes over bus bandwidth")
    out = dict.fromkeys(keys, 0.0)

    def add(key: str, seconds: float) -> None:
        out[key] = out.get(key, 0.0) + seconds

    for op in prof.ops:
        passes = 1.0 + BACKWARD[op.kind] + (1.0 if op.layer is not None else 0.0)
        t = _op_time(hw, op.kind, op.flops, op.nbytes, "float16") * passes
        if op.quadratic:
            add("attention core (scores, softmax, dropout)", t)
        elif op.kind != "memory":
            add("weight GEMMs", t)
        elif op.name in replicated:
            add("elementwise replicated on every rank", t)
        else:
            add("elementwise sharded", t)
        fixed = hw.kernel_overhead if op.kind == "memory" else \
            hw.gemm_knee / (hw.peak("float16") * hw.gemm_efficiency)
        add("  fixed per-kernel cost of the above", min(fixed, t / passes) * passes)
    for c in prof.comms:
        repeats = 2 if c.layer is not None and c.phase == "forward" else 1  # recomputed
        t = collective_time(hw, c.kind, c.nbytes, prof.tp, True) * repeats
        latency = hw.ring_latency(ring_steps(c.kind, prof.tp), True) * repeats if t else 0.0
        add("collectives: latency (launch + ring steps)", latency)
        add("collectives: bytes over bus bandwidth", t - latency)
    return out


def llama70b() -> None:
    from autotp.planner.job.configure import Estimate, Request, search
    from autotp.planner.job.estimate_view import to_table
    from autotp.planner.job.hardware import PRESETS

    transformers = _quiet()
    clock = Stopwatch()
    config = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672,
                                      num_attention_heads=64, num_key_value_heads=8,
                                      num_hidden_layers=80, vocab_size=32000,
                                      max_position_embeddings=4096)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    planner = _planner(model, "llama-2-70b", 4096)
    hw = PRESETS["a100-80gb"]
    req = Request(gpus=64, global_batch=512, seq=4096)
    configs = search(planner, hw, req)
    est = Estimate(model="LLaMA-2-70B shape", hardware=hw, gpus=64, global_batch=512,
                   seq=4096, dtype="bfloat16", precision="bf16-mixed/adam", configs=configs,
                   seconds=clock.seconds)
    print("3. LLaMA-2-70B shape, 64 x A100-80GB, global batch 512 x 4096, bf16 "
          "(published Megatron runs near 50 % MFU)")
    print("   " + to_table(est, top=8).replace("\n", "\n   "))


def context() -> None:
    from autotp.planner.job.configure import estimate
    from autotp.planner.job.estimate_view import to_table

    transformers = _quiet()
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336,
                                      num_attention_heads=32, num_key_value_heads=8,
                                      num_hidden_layers=32, vocab_size=128256,
                                      max_position_embeddings=524288)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    for seq, batch in ((524288, 8), (8192, 256)):
        est = estimate(model, gpus=32, global_batch=batch, seq=seq, hardware="h100",
                       model_name="LLaMA-3-8B shape")
        print(f"4. LLaMA-3-8B shape, 32 x H100 (8 per node), global batch {batch} x {seq}, "
              "bf16")
        print("   " + to_table(est, top=6).replace("\n", "\n   "))
        fitting = [c for c in est.configs if c.fits and c.time is not None]
        for what, pick in (("with tp > 1", lambda c: c.tp > 1),
                           ("with tp across a node", lambda c: c.tp == 8)):
            kind = [c for c in fitting if pick(c) and (c.cp > 1) == (seq > 8192)]
            if fitting and kind and fitting[0].time is not None and kind[0].time is not None:
                print(f"   the best {what}: {kind[0].mesh} mb={kind[0].micro_batch} "
                      f"sp={'on' if kind[0].sequence_parallel else 'off'}, "
                      f"{kind[0].time.step:.1f} s ({kind[0].time.step / fitting[0].time.step:.3f}"
                      f"x the best; tp {kind[0].time.tp_comm:.1f} s of it), "
                      f"{kind[0].memory.total / 2**30 if kind[0].memory else 0:.1f} GiB")


# (hidden, layers, micro-batch, sequence, recomputation) of the LLaMA shapes timed on a GPU
GPU_CASES = ((1024, 8, 8, 1024, "none"), (2048, 8, 4, 2048, "none"),
             (2048, 8, 4, 2048, "full"), (4096, 4, 2, 4096, "none"))


def _llama(transformers: Any, hidden: int, layers: int) -> Any:
    return transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 4,
                                    num_attention_heads=hidden // 128,
                                    num_key_value_heads=hidden // 128,
                                    num_hidden_layers=layers, vocab_size=32000)


def predicted(hw: Any, hidden: int, layers: int, batch: int, seq: int, policy: str) -> Any:
    """autotp estimate's configuration for one GPU training the LLaMA shape as ``measure``
    does: everything in bfloat16 (the AdamW moments too), persistent gradients."""
    from autotp.planner.job.configure import Request, search

    with torch.device("meta"):
        meta = _quiet().LlamaForCausalLM(_llama(_quiet(), hidden, layers))
    req = Request(gpus=1, global_batch=batch, seq=seq, mesh=(1, 1, 1), micro_batch=batch,
                  checkpointing=policy, sequence_parallel=False, dp_shard="none",
                  precision="bf16", optimizer="adamw")
    return search(_planner(meta, "llama", seq), hw, req)[0]


def measure(hidden: int, layers: int, batch: int, seq: int, policy: str,
            steps: int = 5) -> dict[str, float]:
    """One GPU's training step of the LLaMA shape in bfloat16 with fused AdamW: the forward
    and backward, the optimizer step, the model states, what the forward leaves allocated
    for backward, and the peak."""
    transformers = _quiet()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama(transformers, hidden, layers))
    model = model.to("cuda", torch.bfloat16)
    if policy == "full":  # each decoder layer under a checkpoint: its input kept
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, 32000, (batch, seq), device="cuda")
    sync = torch.cuda.synchronize

    def fwd_bwd() -> None:
        loss = model(input_ids=ids, labels=ids).loss  # the outputs freed before backward
        loss.backward()

    for _ in range(3):
        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients persist, as the estimate counts them
    sync()
    states = torch.cuda.memory_allocated()
    loss = model(input_ids=ids, labels=ids).loss
    sync()
    saved = torch.cuda.memory_allocated() - states
    del loss
    torch.cuda.reset_peak_memory_stats()

    def optimizer_step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=False)

    # a step's two parts timed apart, round robin: each optimizer step follows a backward
    times = time_round_robin({"compute": fwd_bwd, "optimizer": optimizer_step}, warmup=0,
                             repeats=steps, before=sync, after=sync)
    return {"compute": times["compute"].median, "optimizer": times["optimizer"].median,
            "states": states, "saved": saved, "peak": torch.cuda.max_memory_allocated()}


def gpu() -> None:
    if not torch.cuda.is_available():
        print("5. no CUDA device: the predicted-against-measured step is skipped")
        return
    from autotp.planner.job.hardware import PRESETS, calibrate

    name = torch.cuda.get_device_name().lower()
    base = PRESETS["h200" if "h200" in name else "h100" if "h100" in name else "a100-80gb"]
    hw, _ = calibrate(base, dtype="bfloat16")
    print(f"5. {torch.cuda.get_device_name()}: predicted (calibrated {base.name}) / measured, "
          "tp 1, LLaMA shapes, everything bfloat16, fused AdamW")
    print(f"   {'h':>5} {'L':>2} {'b':>2} {'s':>5} {'ckpt':>4} | {'fwd+bwd ms':>15} "
          f"{'optimizer ms':>13} | {'states GiB':>11} {'saved GiB':>11} {'peak GiB':>11}")
    gib = float(1 << 30)
    for hidden, layers, batch, seq, policy in GPU_CASES:
        c = predicted(hw, hidden, layers, batch, seq, policy)
        got = measure(hidden, layers, batch, seq, policy)
        torch.cuda.empty_cache()
        m, t = c.memory, c.time
        pairs = [(t.compute * 1e3, got["compute"] * 1e3), (t.optimizer * 1e3,
                                                           got["optimizer"] * 1e3),
                 ((m.parameters + m.gradients + m.optimizer) / gib, got["states"] / gib),
                 (m.activations / gib, got["saved"] / gib), (m.total / gib, got["peak"] / gib)]
        cells = [f"{a:.1f}/{b:.1f}" if i < 2 else f"{a:.2f}/{b:.2f}"
                 for i, (a, b) in enumerate(pairs)]
        print(f"   {hidden:>5} {layers:>2} {batch:>2} {seq:>5} {policy:>4} | {cells[0]:>15} "
              f"{cells[1]:>13} | {cells[2]:>11} {cells[3]:>11} {cells[4]:>11}  "
              f"(step {t.step / (got['compute'] + got['optimizer']):.2f}x, "
              f"peak {m.total / got['peak']:.2f}x)")


STEPS = {"activations": activations, "megatron": megatron, "llama70b": llama70b,
         "context": context, "gpu": gpu}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(STEPS), help="comma-separated steps")
    args = parser.parse_args()
    for name in args.only.split(","):
        clock = Stopwatch()
        STEPS[name.strip()]()
        print(f"   ({clock.seconds:.1f} s)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
