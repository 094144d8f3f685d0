"""Baton's login-node side: CLI, config validation, planning and submission.

Nothing here imports torch, megatron, h5py or zmq (checked by tests/unit/test_layering.py).
"""
