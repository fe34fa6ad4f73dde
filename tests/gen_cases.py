"""Generation cases run on every rank of a process group
(``autotp.runtime.launch.run_processes``) or on every simulated rank: the sharded model's
``generate`` against the unsharded model's."""

from __future__ import annotations

from typing import Any, Callable

import torch

from autotp.verification.verify import max_difference, perturb
from tests.ckpt_cases import VOCAB, bigcode, gpt2, llama


def qwen2() -> Any:
    """Biases on q/k/v, 2 k/v heads, untied head."""
    import transformers as tf

    return tf.Qwen2ForCausalLM(tf.Qwen2Config(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False))


def bloom() -> Any:
    """Attention over batch x heads merged ([B*H, T, D]) with an alibi bias; the cache
    holds [B, H, T, D]."""
    import transformers as tf

    return tf.BloomForCausalLM(tf.BloomConfig(
        n_layer=2, hidden_size=64, n_head=8, vocab_size=VOCAB, bos_token_id=0,
        eos_token_id=0, pad_token_id=0))


BUILDERS: dict[str, Callable[[], Any]] = {"gpt2": gpt2, "llama": llama, "qwen2": qwen2,
                                          "bigcode": bigcode, "bloom": bloom}
NEW_TOKENS = 6


def model(name: str) -> Any:
    torch.manual_seed(0)
    return perturb(BUILDERS[name](), seed=1, std=0.05).eval()


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of three prompts of 7, 5 and 3 tokens."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (3, 7), generator=generator)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def kv_bound(config: Any, tp: int, rank: int, batch: int, length: int,
             element: int = 4) -> int:
    """Bytes of ``rank``'s cache: its k/v heads, 1/tp of them when tp divides them, else the
    k/v heads that the rank's query heads read."""
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    if kv_heads % tp == 0:
        local = kv_heads // tp
    else:
        group, block = heads // kv_heads, heads // tp
        first, last = rank * block, (rank + 1) * block - 1
        local = last // group - first // group + 1
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    return 2 * layers * batch * local * length * head_dim * element


def generate_case(rank: int, world_size: int, names: list[str],
                  mesh: bool = False) -> dict[str, Any]:
    """Per model: seeded sampling (first, so that building the decoding programs inside
    ``generate`` is part of what must not disturb the random stream), greedy decoding, the
    cache's bytes and the collectives of one decode step. ``mesh``: the group is given as a
    1-D DeviceMesh."""
    import autotp

    torch.set_num_threads(1)
    group = None
    if mesh:
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))["tp"]
    out: dict[str, Any] = {}
    for name in names:
        reference = model(name)
        sharded = autotp.parallelize(model(name), tp=world_size, group=group)
        out[name] = compare_generation(reference, sharded)
    return out


def compare_generation(reference: Any, sharded: Any) -> dict[str, Any]:
    ids, mask = prompts()
    common = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    torch.manual_seed(11)
    want = reference.generate(ids, do_sample=True, top_p=0.9, **common)
    torch.manual_seed(11)
    got = sharded.generate(ids, do_sample=True, top_p=0.9, **common)
    sampled = torch.equal(want, got)
    want = reference.generate(ids, do_sample=False, **common)
    got = sharded.generate(ids, do_sample=False, **common)
    greedy = torch.equal(want, got)
    # one decode step by hand: the cache after the prompt, then one token (the prompt's
    # program keeps the last position's logits, as generate's does: no third capture)
    with torch.no_grad():
        first = sharded(ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        cache = first.past_key_values
        step_mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
        nxt = first.logits[:, -1].argmax(-1, keepdim=True)
        sharded.comm.log.clear()
        second = sharded(nxt, attention_mask=step_mask, past_key_values=cache, use_cache=True)
        events = [(e.kind, e.layer) for e in sharded.comm.log.events]
        ref_first = reference(ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        ref_second = reference(nxt, attention_mask=step_mask,
                               past_key_values=ref_first.past_key_values, use_cache=True)
    return {
        "sampled": sampled,
        "greedy": greedy,
        "tokens": got.tolist(),
        "logits_diff": max_difference(ref_second.logits, second.logits),
        "prefill_diff": max_difference(ref_first.logits, first.logits),
        "cache_bytes": cache.nbytes,
        "cache_length": cache.capacity,
        "step_events": events,
    }


def cuda_case(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    """On this rank's GPU (NCCL): generate with the decode step replayed as a CUDA graph, and
    op by op, against the unsharded model on the same GPU."""
    import autotp

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    ids, mask = (t.to(device) for t in prompts())
    common = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0,
                  return_dict_in_generate=True)
    out: dict[str, Any] = {}
    for name in names:
        reference = model(name).to(device)
        sharded = autotp.parallelize(model(name).to(device), tp=world_size)
        want = reference.generate(ids, do_sample=False, **common).sequences
        graphed = sharded.generate(ids, do_sample=False, **common)
        eager = sharded.generate(ids, do_sample=False, cuda_graphs=False, **common)
        torch.manual_seed(11)
        sampled_want = reference.generate(ids, do_sample=True, top_p=0.9, **common).sequences
        torch.manual_seed(11)
        sampled = sharded.generate(ids, do_sample=True, top_p=0.9, **common).sequences
        out[name] = {
            "graph": torch.equal(graphed.sequences, want),
            "graph_used": graphed.past_key_values.graph is not None,
            "eager": torch.equal(eager.sequences, want),
            "eager_graph_used": eager.past_key_values.graph is not None,
            "sampled": torch.equal(sampled, sampled_want),
        }
    return out
