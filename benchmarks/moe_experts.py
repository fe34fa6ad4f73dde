"""One rank's mixture-of-experts work at tp 8: experts whole against experts sliced.

    python -m benchmarks.moe_experts                          # Qwen3-30B-A3B's experts, CPU
    python -m benchmarks.moe_experts --tokens 4096 --device cuda --dtype bfloat16

At Qwen3-30B-A3B's expert shape (hidden 2048, 128 experts of 768, top 8) and tp 8, a rank
runs, per MoE layer:

    whole   (autotp's plan: S(0) on the stacked weights) 16 experts of 768 on the rows the
            routing sends to them (on average an eighth of the tokens x top-k)
    sliced  (tensor parallelism inside every expert: gate_up S(2), down S(1)) all 128
            experts, 96 columns each, on every row

Both move the same bytes (one all-reduce of the layer's output forward, one of its input's
gradient backward), so the difference is the experts' own compute, timed here with
transformers' own experts module (its grouped-GEMM path on this device) built at each local
shape, forward and backward, on the same tokens, routing and weights. The local shapes are
read from the plan autotp makes for the model on meta (``plan.params``), so the row times
what the plan runs. Prints milliseconds per step, achieved GFLOP/s and the ratio.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import torch

from benchmarks.harness import ratio_text, time_call


HIDDEN, EXPERTS, WIDTH, TOP_K, TP = 2048, 128, 768, 8, 8


def planned_local_shapes() -> dict[str, tuple[int, ...]]:
    """The experts' local shapes in autotp's plan of the shape at tp 8 (meta, one layer)."""
    import transformers

    import autotp

    config = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=HIDDEN, intermediate_size=6144, num_hidden_layers=1,
        num_attention_heads=32, num_key_value_heads=4, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, moe_intermediate_size=WIDTH)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autotp.plan(model, TP, example_kwargs={"input_ids": ids})
    print(f"plan: {plan.experts_summary()}")
    return {t.rsplit(".", 1)[-1]: plan.params[t].local_shape for t in plan.experts}


def experts_module(experts: int, width: int, dtype: torch.dtype, device: str) -> Any:
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=experts,
                                         moe_intermediate_size=width,
                                         num_experts_per_tok=TOP_K)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    module = Qwen3MoeExperts(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, else float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    local = planned_local_shapes()
    whole_experts = local["gate_up_proj"][0]
    assert whole_experts == EXPERTS // TP, local

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, HIDDEN, generator=gen).to(args.device, dtype)
    scores = torch.randn(args.tokens, EXPERTS, generator=gen).softmax(-1)
    weights, index = scores.topk(TOP_K, dim=-1)
    weights, index = weights.to(args.device, dtype), index.to(args.device)
    # rank 0's rows under experts whole: the (token, choice) pairs routed to experts 0..15
    token, choice = (index < whole_experts).nonzero(as_tuple=True)
    rows = dict(
        whole=(hidden[token], index[token, choice][:, None], weights[token, choice][:, None],
               experts_module(whole_experts, WIDTH, dtype, args.device)),
        sliced=(hidden, index, weights,
                experts_module(EXPERTS, WIDTH // TP, dtype, args.device)))
    print(f"{args.tokens} tokens x top {TOP_K} of {EXPERTS} experts, hidden {HIDDEN}, width "
          f"{WIDTH}, tp {TP}, {args.device} {str(dtype).removeprefix('torch.')}")
    print(f"{'layout':8s} {'experts':>8s} {'width':>6s} {'rows':>7s} {'ms/step':>9s} "
          f"{'GFLOP/s':>8s}")
    results = {}
    for name, (x, idx, w, module) in rows.items():
        x = x.detach().requires_grad_()

        def step(module: Any = module, x: torch.Tensor = x, idx: torch.Tensor = idx,
                 w: torch.Tensor = w) -> None:
            module.zero_grad(set_to_none=True)
            module(x, idx, w).float().sum().backward()

        sync = torch.cuda.synchronize if args.device == "cuda" else None
        seconds = time_call(step, warmup=2, repeats=args.reps, before=sync, after=sync).median
        width = module.down_proj.shape[-1]
        flops = 3 * 2 * idx.numel() * HIDDEN * 3 * width  # fwd + bwd, gate|up and down
        results[name] = seconds
        print(f"{name:8s} {module.num_experts:8d} {width:6d} {idx.numel():7d} "
              f"{seconds * 1e3:9.2f} {flops / seconds / 1e9:8.1f}")
    print(f"sliced / whole: {ratio_text(results['sliced'] / results['whole'], suffix='x')} "
          "the time per step")


if __name__ == "__main__":
    main()
