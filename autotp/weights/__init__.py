"""Weights: each rank's slices of the parameters, from the model in memory or from
safetensors checkpoints (tensorfile, materialize)."""
