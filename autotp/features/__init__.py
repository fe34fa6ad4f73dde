"""Features built on the plan and the rank program: loading and saving checkpoints
(checkpoint), generation with a sharded KV cache,
pipeline stages, verification against the unsharded model, the plan's reports and pages,
what autograd keeps for backward (measured), and the testing helpers."""
