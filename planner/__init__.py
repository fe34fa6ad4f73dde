"""The plan search: the problem (problem), the dynamic program over it (solve, frontier)
under the cost model (cost) and the redistributions between layouts (transitions), the plan
it assembles (plan, assemble; sibling all-reduces joined: coalesce; layer-invariant values:
invariant; what autograd keeps: saved), its checks (checks, gradflow), the op that stops a
matrix kept whole from being sharded (blockers) and plans kept across processes (cache).
The job model of ``autotp estimate`` (job) reads the plans; nothing here reads it."""
