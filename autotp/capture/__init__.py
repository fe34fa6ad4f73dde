"""Capture: the user's model into one torch.fx graph of ATen ops (torch.export with symbolic
batch and sequence), normalized for the rules (trace, passes), repeated layers traced once
(repeat), branches decided or followed (branches), sums regrouped (sums), and the models the
command line names (named_models)."""
