"""What the rank server of ``gpt_harness`` imports once, so that no rank pays for it."""
import warnings

warnings.filterwarnings("ignore")  # Megatron's "TE/Apex missing" and deprecation noise

from core.parallel.imports import import_megatron  # noqa: E402  after the filter

import_megatron()

import core.checkpoint.service  # noqa: E402,F401  what every rank imports
import core.model.gpt.model  # noqa: E402,F401
import core.model.gpt.optim  # noqa: E402,F401
import core.model.gpt.state  # noqa: E402,F401
import core.model.gpt.step  # noqa: E402,F401
import core.model.gpt.task  # noqa: E402,F401
import core.parallel.cpu_shim  # noqa: E402,F401
import core.parallel.megatron  # noqa: E402,F401
