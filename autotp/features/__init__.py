"""Features built on the plan and the rank program: loading and saving in transformers'
layout (pretrained), training checkpoints (checkpoint), generation with a sharded KV cache
(generate; its programs: steps), pipeline stages (pipeline; the program cut between its
layers: cut), verification against the unsharded model (verify; of a model the command line
names: check_model), exact gradient clipping (clipping), the plan's reports (report) and
pictures (render: the view; dot: Graphviz; page: HTML), the plan as transformers' tp_plan
and torch's parallelize_module styles (export; its reading of the graph: export_graph; the
two vocabularies: styles), why a layout was chosen, each candidate forced and re-planned
(explain), what autograd keeps for backward, measured (saved_tensors), and the rules'
testing helpers (testing)."""
