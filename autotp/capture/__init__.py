"""Capture: the user's model into one torch.fx graph of ATen ops (torch.export with symbolic
batch and sequence), normalized for the rules (trace, passes; ops that return their input:
identities; norms between two matrices in partial sums: feature_norms), a node as the rules
see it (op_calls), repeated layers traced once (repeat) and found by structure (blocks),
branches decided or followed (branches), sums regrouped (sums), what export cannot take as it
is made traceable (traceable: reentrant checkpoints, caches; shared_buffers; the model's own
output containers: outputs), and the models the command line names (named_models)."""
