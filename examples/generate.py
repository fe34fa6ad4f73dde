"""Generate text with a transformers causal LM sharded over the ranks.

    # a small LLaMA checkpoint with random weights to try it on (or use any local model dir)
    python examples/train_from_checkpoint.py --make-demo demo-llama

    torchrun --nproc-per-node 2 examples/generate.py --model demo-llama --check
    torchrun --nproc-per-node 4 examples/generate.py --model demo-llama \\
        --max-new-tokens 64 --sample --top-p 0.9 --batch 4

Every rank reads only its slices of the weights (autotp.from_pretrained) and keeps a KV cache
of its own heads; transformers' generate() drives the loop (here with a streamer that prints
rank 0's tokens as they come). The prompts are random token ids of different lengths, left
padded: pass a tokenizer's output instead. ``--check`` also runs the unsharded model on rank
0 and compares the tokens (greedy).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import autotp


class PrintIds:
    """A transformers streamer printing the first sequence's new token ids (no tokenizer)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() puts the prompt first
            self.prompt_seen = True
            return
        if self.enabled:
            print(int(value.reshape(-1)[0]), end=" ", flush=True)

    def end(self) -> None:
        if self.enabled:
            print()


def prompts(batch: int, length: int, vocab: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)  # the same prompts on every rank
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):  # shorter prompts, padded on the left
        mask[row, : min(length - 1, 3 * row)] = 0
    return ids.masked_fill(mask == 0, pad), mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="transformers model directory")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the model's)")
    parser.add_argument("--check", action="store_true",
                        help="compare with the unsharded model on rank 0 (greedy)")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = autotp.api.default_device()
    sharded = autotp.from_pretrained(args.model, tp=world, device=device,
                                     dtype=getattr(torch, args.dtype) if args.dtype else None)
    config = sharded.source.config
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    ids, mask = prompts(args.batch, args.prompt_length, config.vocab_size, pad)
    ids, mask = ids.to(device), mask.to(device)
    options = dict(attention_mask=mask, max_new_tokens=args.max_new_tokens, pad_token_id=pad)
    if args.sample:
        options.update(do_sample=True, top_p=args.top_p)
    else:
        options.update(do_sample=False)

    torch.manual_seed(args.seed)  # the same seed on every rank: the same samples
    start = time.perf_counter()
    out = sharded.generate(ids, streamer=PrintIds(rank == 0), **options)
    elapsed = time.perf_counter() - start
    if rank == 0:
        new = out.shape[1] - ids.shape[1]
        print(f"tp={world}: {args.batch} x {new} new tokens in {elapsed:.2f} s "
              f"(first call: includes capturing the prefill and decode programs)")
    if args.check and not args.sample and rank == 0:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, dtype=next(sharded.parameters()).dtype)
        want = model.to(device).eval().generate(ids, **options)
        same = torch.equal(want, out)
        print(f"unsharded model: {'the same tokens' if same else 'DIFFERENT tokens'}")
        if not same:
            raise SystemExit(1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
