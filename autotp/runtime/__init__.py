"""Runtime: the plan rewritten into one program per rank (rewrite), each op lowered to local
shards (lowerings), peephole fusions of the rank program (fusion), its collectives and their
autograd (collectives, comm, regather),
gathers joined ahead of the first layer (batching), rows routed to their experts (routed_rows),
tracked randomness (random), the program cut at its layers (layers), attention over a
sequence sharded on a context-parallel group (context: ring and Ulysses), and process
launching for the CPU tests and examples (launch)."""
