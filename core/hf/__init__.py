"""Hugging Face checkpoints: their families (config.json), their tensors as Baton's, reading them."""
