"""The plan search: the problem (problem; the blocks a split or a view asks for:
segmentations), the dynamic program over it (solve, frontier) under the cost model (cost) and
the redistributions between layouts (transitions), checked against the column/row plan of
the matrices' roles (column_row), the plan it assembles (plan, assemble; sibling all-reduces
joined: coalesce; layer-invariant values: invariant; what autograd keeps: saved; attention
masks by their positions: masks), the plan over a context-parallel axis (context), its
checks (checks, gradflow), the one verdict on Megatron's bound (bound), the op that stops a
matrix kept whole from being sharded (blockers) and plans kept across processes (cache).
The job model of ``autotp estimate`` (job) reads the plans; nothing here reads it."""
