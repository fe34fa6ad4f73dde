"""Train the nanoGPT-style model of examples/nanogpt.py with autotp tensor parallelism.

    torchrun --nproc-per-node 2 examples/train_nanogpt.py --steps 20
    torchrun --nproc-per-node 8 examples/train_nanogpt.py --n-layer 24 --n-embd 1024 --n-head 16

tp (the number of processes) must divide the heads. NCCL on GPUs when CUDA is available,
gloo on CPU otherwise. Gradients are clipped by the whole model's norm
(``autotp.clip_grad_norm_``). The model file is unmodified
single-device code; autotp finds the Megatron layout (fused qkv included) from its graph.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import autotp
from nanogpt import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    args = parser.parse_args()

    device = autotp.api.default_device()  # cuda:LOCAL_RANK where there is CUDA, else the CPU
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same weights on every rank
    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                       vocab_size=1024, block_size=args.seq, dropout=0.0)
    model = GPT(config).to(device)
    idx = torch.randint(0, config.vocab_size, (2, 16), device=device)
    sharded = autotp.parallelize(model, example_args=(idx, idx))  # inputs and targets
    del model
    if rank == 0:
        print(sharded.plan.summary())

    opt = torch.optim.AdamW(sharded.parameters(), lr=3e-4)
    data = torch.Generator().manual_seed(1)  # the same batches on every rank
    for step in range(args.steps):
        x = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=data)
        x = x.to(device)
        start = time.perf_counter()
        _, loss = sharded(x[:, :-1].contiguous(), x[:, 1:].contiguous())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = autotp.clip_grad_norm_(sharded, args.max_grad_norm)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            ms = 1e3 * (time.perf_counter() - start)
            print(f"step {step:3d}  loss {loss.item():.4f}  grad norm {float(norm):.3f}  "
                  f"{ms:.0f} ms")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
