"""autotp in the user's stack: loading and saving in transformers' layout (pretrained),
training checkpoints (checkpoint), generation with a sharded KV cache (generate; its prefill
and decode programs: steps), pipeline stages (pipeline; the program cut between its layers:
cut), exact gradient clipping (clipping), the plan as transformers' tp_plan and torch's
parallelize_module styles (export; its reading of the graph: export_graph; the two
vocabularies: styles), and a user's own ops taught to the planner (custom_ops)."""
