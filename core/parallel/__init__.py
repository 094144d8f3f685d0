"""Parallel layout: the pure value (dims) and, separately, Megatron's initialisation from it."""
