"""autotp's examples: scripts run as files (``python examples/demo.py``, ``torchrun
examples/train_nanogpt.py``) that import only ``autotp`` (installed) and each other by their
plain names (a script's folder is first on ``sys.path``). The tests and benchmarks import the
model code from here as ``examples.nanogpt``; this file makes that a regular package, never
installed."""
