"""Runtime: the plan rewritten into one program per rank (rewrite), its collectives and
their autograd (collectives, comm, regather), tracked randomness (random), the program cut
at its layers (layers), and process launching for the CPU tests and examples (launch)."""
