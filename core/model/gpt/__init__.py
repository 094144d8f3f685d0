"""A Megatron-core GPT served by Baton's workers: model, optimizer, data, one step, state.

``core.model.gpt.task.GPTTask`` is the entry point: a composition of the model roles
(``core.model.gpt.roles``) the plan gives a rank, imported when a task is built, so that
importing this package and the task module costs nothing (``core.model.gpt.optim.lr_at``
and ``core.model.gpt.data`` work without torch too).
"""
