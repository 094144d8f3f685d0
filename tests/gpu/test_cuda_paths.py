"""The CUDA paths, on a GPU only (skipped elsewhere): benchmarks/gpu_check.sh runs them on a lent one.

- the async checkpoint's device-to-host snapshot on a side stream, ordered after the
  work queued before the export (core.model.gpt.state.LiveTensor);
- the tiny GPT on one GPU in bf16 through the controller, with async checkpoints, and a
  resume that continues the uninterrupted run's curve.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import baton, losses, submit_local
from tests.integration.gpt_harness import RankGroup, assert_state_is_the_checkpoints, gpt_config

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.sh)")]


def test_a_side_stream_snapshot_sees_the_work_queued_before_the_export() -> None:
    from core.model.gpt.state import LiveTensor

    t = torch.zeros(1 << 24, device="cuda")  # 64 MiB
    for _ in range(200):  # queued, not yet run, when the export records its event
        t.add_(1.0)
    ready = torch.cuda.Event()
    ready.record()
    live = LiveTensor(t, (1 << 24,), ready)
    out = np.empty((1 << 24,), np.float32)
    writer = threading.Thread(target=live.snapshot_into, args=(out,))  # the writer thread, as in AsyncWriter
    writer.start()
    writer.join(60)
    assert not writer.is_alive(), "the device-to-host copy did not finish within 60 s"
    assert float(out.min()) == float(out.max()) == 200.0  # the copy waited for every queued add


def test_a_bf16_device_tensor_is_cast_into_the_fp32_host_buffer() -> None:
    from core.model.gpt.state import LiveTensor

    t = torch.arange(1024, device="cuda").to(torch.bfloat16)
    out = np.empty((4, 256), np.float32)
    LiveTensor(t, (4, 256)).snapshot_into(out)
    want = torch.arange(1024).to(torch.bfloat16).float().numpy()  # bf16 rounds above 256
    assert np.array_equal(out.reshape(-1), want)


GPT = ["parallel.tp=1", "parallel.pp=1", "trainer.n_gpus_per_node=1", "trainer.device=cuda",
       "optimizer.schedule=constant", "optimizer.warmup_steps=0"]


def _gpt_run(*args: str) -> Path:
    return submit_local("experiments/tiny_gpt.yaml", *GPT, *args)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_tiny_gpt_trains_in_bf16_on_a_gpu_and_an_async_checkpoint_resumes_its_curve(tmp_path: Path) -> None:
    full = _gpt_run(f"runs_root={tmp_path}/full", "trainer.steps=20", "checkpoint.interval_steps=0")
    half = _gpt_run(f"runs_root={tmp_path}/half", "trainer.steps=10", "checkpoint.interval_steps=5",
                    "checkpoint.async=true")
    state = json.loads((half / "state.json").read_text())
    assert state["status"] == "completed", state.get("reason")
    res = baton("submit", "--resume", str(half), "trainer.steps=20", "--backend", "local", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    want, got = losses(full), losses(half)
    assert len(got) == 20 and want[-1] < want[0] * 0.8, want  # it learns
    diffs = [abs(a - b) for a, b in zip(want, got, strict=True)]
    print("max |loss diff| before / after the resume:", max(diffs[:10]), max(diffs[10:]))
    # bf16 kernels with atomics (embedding backward) are not bit-reproducible run to run
    assert max(diffs) <= 1e-2, list(zip(want, got, strict=True))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bf16_state_after_a_resume_is_the_saved_state_bit_for_bit(tmp_path: Path) -> None:
    """On a GPU with whatever Adam Megatron picks there (Transformer Engine's or Apex's fused one
    when installed: it keeps its step in the param groups): after a load in new processes, every
    tensor, step counter, the RNG streams (CUDA ones included) equal the checkpoint's."""
    cfg = gpt_config(trainer={"device": "cuda"}, model={"hidden_dropout": 0.1, "attention_dropout": 0.1},
                     training={"global_batch_size": 16, "micro_batch_size": 4,
                               "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}})
    with RankGroup(cfg, world_size=1, run_dir=tmp_path) as g:
        g.setup()
        g.train(range(5))
        step_dir = g.save(tmp_path / "checkpoints", 5)
    with RankGroup(cfg, world_size=1, run_dir=tmp_path) as g:
        g.setup()
        g.load(step_dir)
        assert_state_is_the_checkpoints(g, step_dir, 5)
        assert all(loss == loss for loss in g.train(range(5, 8)))  # and it trains on
