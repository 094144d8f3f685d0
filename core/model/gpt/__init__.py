"""A Megatron-core GPT served by Baton's workers: model, optimizer, data, one step, state.

Only ``core.model.gpt.task.GPTTask`` is the entry point; the modules below it are imported
lazily so that importing this package costs nothing (``core.model.gpt.optim.lr_at`` and
``core.model.gpt.data`` work without torch).
"""
