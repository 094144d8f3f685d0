"""core.model.gpt.state's checkpoint items: live tensors read at write time, and host copies."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from core.errors import CheckpointError
from core.model.gpt.state import LiveTensor, _numpy


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


def test_a_live_fp32_tensor_is_a_view_for_sync_writes_and_copied_into_the_writers_buffer() -> None:
    t = torch.arange(6, dtype=torch.float32)
    live = LiveTensor(t, (1, 2, 3))
    view = live.current()
    assert view.shape == (1, 2, 3) and np.shares_memory(view, t.numpy())  # no copy for a sync save
    out = np.empty((1, 2, 3), np.float32)
    live.snapshot_into(out)
    t += 100  # the optimizer step after the fence: the snapshot keeps the old values
    assert np.array_equal(out.reshape(-1), np.arange(6, dtype=np.float32))
    assert np.array_equal(view.reshape(-1), np.arange(6, dtype=np.float32) + 100)


def test_a_live_bf16_tensor_is_cast_into_the_fp32_buffer() -> None:
    t = torch.arange(6, dtype=torch.bfloat16)
    live = LiveTensor(t, (6,))
    out = np.empty((6,), np.float32)
    live.snapshot_into(out)
    assert np.array_equal(out, np.arange(6, dtype=np.float32))
    assert live.current().dtype == np.float32 and not np.shares_memory(live.current(), out)


def test_a_live_tensor_that_does_not_fill_its_slice_is_refused() -> None:
    with pytest.raises(CheckpointError, match=r"does not fill the slice shape \(7,\)"):
        LiveTensor(torch.zeros(6), (7,))
