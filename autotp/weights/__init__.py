"""Weights: each rank's slices of the parameters, from the model in memory, from safetensors
checkpoints (tensorfile, materialize), and sharded training checkpoints (checkpoint)."""
