"""Capture: the user's model into one torch.fx graph of ATen ops (torch.export with symbolic
batch and sequence), normalized for the rules (trace), fused idioms recognized (fusion), and
the models the command line names (named_models)."""
