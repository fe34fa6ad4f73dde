"""Runtime: the plan rewritten into one program per rank (rewrite), each op lowered to local
shards (lowerings), peephole fusions of the rank program (fusion), its collectives and their
autograd (collectives, comm, regather), gathers joined ahead of the first layer (batching),
rows routed to their experts (routed_rows), tracked randomness (random), the program cut at
its layers (layers), attention over a sequence sharded on a context-parallel group (ring:
ring and Ulysses; each ring step's fused attention kernels: ring_kernels; a mask program read
block by block: block_mask), a traced causal mask run by the kernel's causal path (causal), a
program per input structure of the calls (calls), gradients as the tools around the model
read them (grads), wrappers refused over tensor-parallel peers (wrappers), what transformers'
Trainer reads of the module (contract), and process launching for the CPU tests and examples
(launch)."""
