"""Parallelize an unmodified Hugging Face LLaMA (GQA) and check it against the original.

    torchrun --nproc-per-node 4 examples/hf_llama.py

4 query-head groups per rank and 2 key/value heads: at tp = 4 autotp replicates the k/v
projections (their gradients are summed once after backward) and keeps Megatron's two
all-reduces per layer in each direction.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

import autotp
from autotp.verification.verify import compare, layer_counts, reference_step, sharded_step


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    device = autotp.api.default_device()  # cuda:LOCAL_RANK where there is CUDA, else the CPU
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256,
                                      intermediate_size=688, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=1024)
    model = transformers.LlamaForCausalLM(config).to(device)
    sharded = autotp.parallelize(model)  # example input derived from the config
    ids = torch.randint(0, 1024, (4, 96), generator=torch.Generator().manual_seed(1)).to(device)

    def call(m):
        return m(input_ids=ids)

    def loss(out):
        return out.logits.float().logsumexp(-1).mean()

    def logits(out):
        return out.logits

    reference = reference_step(model, call, loss, logits)
    cmp = compare(reference, sharded_step(sharded, call, loss, logits))
    if dist.get_rank() == 0:
        print(sharded.plan.summary())
        print(f"max |logits diff| {cmp.output_diff:.2e}, max |grad diff| {cmp.grad_diff:.2e}")
        print("per layer (forward, backward):",
              {k: (v["forward"], v["backward"]) for k, v in layer_counts(sharded.comm.log).items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
