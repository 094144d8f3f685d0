"""core.gpt.state's host copies: each exported array is private, made with one copy."""
from __future__ import annotations

import numpy as np
import torch

from core.gpt.state import _numpy


def test_fp32_host_tensor_is_copied_so_training_cannot_change_the_snapshot() -> None:
    t = torch.arange(6, dtype=torch.float32)
    out = _numpy(t)
    t += 100
    assert np.array_equal(out, np.arange(6, dtype=np.float32))


def test_a_cast_is_the_copy_no_second_one_is_made() -> None:
    t = torch.arange(6, dtype=torch.bfloat16)
    out = _numpy(t)
    assert out.dtype == np.float32 and out.flags.owndata is False  # the cast's own buffer, not a copy of it
    t += 100
    assert np.array_equal(out, np.arange(6, dtype=np.float32))
