"""Load a transformers checkpoint directory sharded over the ranks, train, save, resume.

    # a small LLaMA checkpoint with random weights to try it on (or use any local model dir)
    python examples/train_from_checkpoint.py --make-demo demo-llama

    torchrun --nproc-per-node 4 examples/train_from_checkpoint.py --model demo-llama \\
        --steps 20 --checkpoint ckpt                     # saves ckpt/step-20
    torchrun --nproc-per-node 2 examples/train_from_checkpoint.py --model demo-llama \\
        --steps 20 --checkpoint ckpt --resume ckpt/step-20 --export out-model

Every rank reads only its slices of the weights (autotp.from_pretrained); checkpoints are
written by all ranks in parallel and resume at any tp; --export writes transformers' layout.
The batches are random tokens: swap in a data loader.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

import autotp


def make_demo(directory: str) -> None:
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256,
                                      intermediate_size=688, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=4096,
                                      max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="2MB")
    print(f"wrote {directory}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="transformers model directory (safetensors)")
    parser.add_argument("--make-demo", metavar="DIR", help="write a small random LLaMA")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--checkpoint", help="directory for resumable checkpoints")
    parser.add_argument("--resume", help="a checkpoint written by an earlier run, any tp")
    parser.add_argument("--export", help="write the trained model in transformers' layout")
    args = parser.parse_args()
    if args.make_demo:
        make_demo(args.make_demo)
        return
    if not args.model:
        parser.error("--model is required (or --make-demo DIR)")

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = autotp.api.default_device()
    ids = torch.randint(0, 100, (args.batch, args.seq), device=device)
    sharded = autotp.from_pretrained(args.model, tp=world, dtype=getattr(torch, args.dtype),
                                     training=True, device=device,
                                     example_kwargs={"input_ids": ids, "labels": ids})
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=args.lr)
    first = 0
    if args.resume:
        autotp.load_checkpoint(sharded, args.resume, optimizer=optimizer)
        first = int(Path(args.resume).name.rpartition("-")[2] or 0)
    if rank == 0:
        print(sharded.plan.summary().splitlines()[0])
    vocab = sharded.source.config.vocab_size if sharded.source and sharded.source.config \
        else 100
    generator = torch.Generator().manual_seed(1234)  # the same batches on every rank
    for step in range(first, first + args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = sharded(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 5 == 0 or step == first + args.steps - 1):
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
    if args.checkpoint:
        target = Path(args.checkpoint) / f"step-{first + args.steps}"
        autotp.save_checkpoint(sharded, target, optimizer=optimizer)
        if rank == 0:
            print(f"saved {target} (tp={world}; resumes at any tp)")
    if args.export:
        autotp.save_pretrained(sharded, args.export)
        if rank == 0:
            print(f"exported {args.export} (transformers' layout)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
