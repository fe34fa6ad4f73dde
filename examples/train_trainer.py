"""transformers' Trainer on an autotp model: nothing autotp-specific but the parallelize call.

    torchrun --nproc-per-node 2 examples/train_trainer.py --tp 2
    torchrun --nproc-per-node 4 examples/train_trainer.py --dp 2 --tp 2

A (dp, tp) DeviceMesh; autotp shards an unmodified transformers LLaMA over "tp" and Trainer
does the rest as it does for transformers' own tensor-parallel models: the ranks of a "tp"
group get the same batches, no DDP wraps the module (autotp averages the gradients over
"dp"), the loss is scaled by the tokens counted over the "dp" ranks, and the gradients are
clipped by the whole model's norm. Prints each step's loss and gradient norm, then the
evaluation loss; the last line is the number of parameters this rank holds of the whole.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist

import autotp


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, labels = inputs (a causal LM's loss)."""

    def __init__(self, count: int, length: int, vocab: int, seed: int):
        self.ids = torch.randint(0, vocab, (count, length),
                                 generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def main() -> None:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="per data-parallel rank")
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()

    transformers.logging.set_verbosity_error()
    device = autotp.api.default_device()  # cuda:LOCAL_RANK where there is CUDA, else the CPU
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.get_world_size() != args.dp * args.tp:
        raise SystemExit(f"--dp {args.dp} x --tp {args.tp} must equal the world size "
                         f"{dist.get_world_size()}")
    mesh = init_device_mesh(device.type, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)  # the same weights on every rank
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128,
                                      intermediate_size=344, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=args.seq)
    model = transformers.LlamaForCausalLM(config)
    train = Tokens(64, args.seq, config.vocab_size, seed=1)
    sharded = autotp.parallelize(model, tp=args.tp, group=mesh["tp"],
                                 example_kwargs={"input_ids": train.ids[:args.batch]})

    trainer = transformers.Trainer(
        model=sharded,
        args=transformers.TrainingArguments(
            output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch,
            learning_rate=1e-3, max_steps=args.steps, logging_steps=1, save_strategy="no",
            report_to=[], disable_tqdm=True, use_cpu=device.type == "cpu"),
        train_dataset=train, eval_dataset=Tokens(8, args.seq, config.vocab_size, seed=2))
    trainer.train()
    evaluation = trainer.evaluate()
    if dist.get_rank() == 0:
        for row in trainer.state.log_history:
            if "loss" in row:
                print(f"step {row['step']}: loss {row['loss']:.5f}, "
                      f"grad norm {row['grad_norm']:.5f}")
        print(f"evaluation loss {evaluation['eval_loss']:.5f}")
        local = sum(p.numel() for p in sharded.parameters())
        print(f"dp={args.dp} x tp={args.tp}: rank 0 holds {local} of "
              f"{sum(p.numel() for p in model.parameters())} parameters")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
