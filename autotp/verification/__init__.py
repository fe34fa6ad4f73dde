"""The sharded model checked against the unsharded one: equivalence of forward and backward
(verify; of a model the command line names: check_model), what autograd keeps for backward,
measured (saved_tensors), and the rules' testing helpers (testing)."""
