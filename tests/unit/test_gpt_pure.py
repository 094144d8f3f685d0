"""The torch-free parts of core.model.gpt: the learning-rate schedule and the batch sampler."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.checkpoint.spec import TensorSlice
from core.config import run as config_mod
from core.errors import ConfigError
from core.model.gpt.data import BatchSource, dp_sample_range, from_config, num_micro_batches, resolve_micro_batch
from core.model.gpt.optim import lr_at
from core.model.gpt.state import assemble

REPO = Path(__file__).resolve().parents[2]


def _cfg(**sections: dict) -> config_mod.RunConfig:
    data = {"trainer": {"steps": 100}, "optimizer": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10}}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return config_mod.from_data(data)


def _source(**overrides: object) -> BatchSource:
    kwargs: dict = dict(kind="synthetic", task="increment", path=None, seed=7, vocab_size=128, seq_length=32,
                        global_batch=16, micro_batch=2, dp=1, dp_rank=0)
    kwargs.update(overrides)
    return BatchSource(**kwargs)


# --- lr_at -----------------------------------------------------------------------------------
def test_lr_warms_up_linearly_from_a_nonzero_first_step() -> None:
    cfg = _cfg()
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert [lr_at(s, cfg) for s in range(10)] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])


def test_lr_cosine_decays_from_peak_to_min_lr_at_the_last_step() -> None:
    cfg = _cfg()
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(55, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert lr_at(100, cfg) == pytest.approx(1e-4)
    assert lr_at(500, cfg) == pytest.approx(1e-4)  # past the end: stays at min_lr
    decay = [lr_at(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))


def test_lr_constant_schedule_and_auto_lr() -> None:
    cfg = _cfg(optimizer={"schedule": "constant", "warmup_steps": 0})
    assert {lr_at(s, cfg) for s in range(0, 200, 7)} == {1e-3}
    auto = _cfg(optimizer={"lr": "auto", "warmup_steps": 0, "min_lr": 0.0}, training={"global_batch_size": 1024})
    assert lr_at(0, auto) == pytest.approx(3e-6)


def test_lr_rejects_a_negative_step() -> None:
    with pytest.raises(ValueError, match="step -1"):
        lr_at(-1, _cfg())


@settings(max_examples=50, deadline=None)
@given(step=st.integers(0, 10_000), warmup=st.integers(0, 50), steps=st.integers(1, 5000))
def test_lr_stays_between_min_lr_and_peak(step: int, warmup: int, steps: int) -> None:
    cfg = _cfg(trainer={"steps": steps}, optimizer={"warmup_steps": warmup})
    lr = lr_at(step, cfg)
    assert 0 < lr <= 1e-3 + 1e-15
    if step >= warmup:
        assert lr >= 1e-4 - 1e-15
    assert math.isfinite(lr)


# --- batches -----------------------------------------------------------------------------------
def test_batches_are_a_pure_function_of_seed_and_step() -> None:
    a, b = _source(), _source()
    for step in (0, 3, 1000):
        for x, y in zip(a.micro_batches(step), b.micro_batches(step), strict=True):
            np.testing.assert_array_equal(x.tokens, y.tokens)
            np.testing.assert_array_equal(x.labels, y.labels)
    assert not np.array_equal(a.micro_batches(0)[0].tokens, a.micro_batches(1)[0].tokens)
    assert not np.array_equal(a.micro_batches(0)[0].tokens, _source(seed=8).micro_batches(0)[0].tokens)


def test_a_resumed_source_reads_the_same_batches_as_an_uninterrupted_one() -> None:
    uninterrupted = _source()
    seen = [uninterrupted.micro_batches(s) for s in range(6)]
    resumed = _source()  # a new process after a checkpoint at step 4
    for step in (4, 5):
        for x, y in zip(resumed.micro_batches(step), seen[step], strict=True):
            np.testing.assert_array_equal(x.tokens, y.tokens)


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_data_parallel_ranks_split_the_same_global_batch(dp: int) -> None:
    whole = np.concatenate([m.tokens for m in _source().micro_batches(3)])
    parts = [np.concatenate([m.tokens for m in _source(dp=dp, dp_rank=r).micro_batches(3)]) for r in range(dp)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_micro_batch_shapes_and_count() -> None:
    batches = _source(dp=2, dp_rank=1, micro_batch=4).micro_batches(0)
    assert len(batches) == 2
    assert {m.tokens.shape for m in batches} == {(4, 32)} and batches[0].tokens.dtype == np.int64
    assert num_micro_batches(global_batch=16, micro_batch=2, dp=2) == 4
    assert list(dp_sample_range(global_batch=16, dp=4, dp_rank=2)) == [8, 9, 10, 11]
    with pytest.raises(ConfigError, match="micro_batch_size × dp"):
        num_micro_batches(global_batch=16, micro_batch=3, dp=2)


def test_auto_micro_batch_divides_the_per_replica_batch() -> None:
    assert resolve_micro_batch("auto", global_batch=16, dp=2) == 4
    assert resolve_micro_batch("auto", global_batch=12, dp=2) == 2
    assert resolve_micro_batch("auto", global_batch=7, dp=1) == 1
    assert resolve_micro_batch(3, global_batch=12, dp=2) == 3


def test_synthetic_tasks_have_their_labels() -> None:
    inc = _source().micro_batches(0)[0]
    np.testing.assert_array_equal(inc.labels, (inc.tokens + 1) % 128)
    copy = _source(task="copy").micro_batches(0)[0]
    window = np.concatenate([copy.tokens, copy.labels[:, -1:]], axis=1)  # the seq + 1 tokens
    np.testing.assert_array_equal(window[:, 17:33], window[:, :16])
    np.testing.assert_array_equal(copy.labels[:, :-1], copy.tokens[:, 1:])
    rnd = _source(task="random").micro_batches(0)[0]
    assert rnd.tokens.min() >= 0 and rnd.tokens.max() < 128
    np.testing.assert_array_equal(rnd.labels[:, :-1], rnd.tokens[:, 1:])


def test_eval_batches_differ_from_train_batches() -> None:
    s = _source()
    assert not np.array_equal(s.micro_batches(0, "eval")[0].tokens, s.micro_batches(0, "train")[0].tokens)


def _token_file(path: Path, tokens: np.ndarray, vocab: int, **create: object) -> Path:
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=tokens, **create)
        f.attrs["vocab_size"] = vocab
    return path


def test_hdf5_windows_are_memory_mapped_slices_of_the_token_file(tmp_path: Path) -> None:
    tokens = np.arange(5000, dtype=np.uint16)  # token value == position: a window shows where it was read
    path = _token_file(tmp_path / "tok.h5", tokens, 5000)
    src = _source(kind="hdf5", path=str(path), vocab_size=5000)
    assert isinstance(src._tokens, np.memmap)
    windows = {split: [src.sample(s, i, split) for s in range(10) for i in range(16)] for split in ("train", "eval")}
    for t, lab in windows["train"] + windows["eval"]:
        np.testing.assert_array_equal(t, np.arange(t[0], t[0] + 32))
        np.testing.assert_array_equal(lab, t + 1)
    # The last 5 % (250 tokens) are held out: train never reads them, eval reads only them.
    assert max(int(lab[-1]) for _, lab in windows["train"]) < 4750
    assert min(int(t[0]) for t, _ in windows["eval"]) >= 4750
    assert len({int(t[0]) for t, _ in windows["train"]}) > 100  # positions spread over the file


def test_hdf5_reader_falls_back_for_chunked_files_and_checks_the_vocab(tmp_path: Path) -> None:
    tokens = (np.arange(3000, dtype=np.uint32) * 7) % 300
    chunked = _token_file(tmp_path / "chunked.h5", tokens, 300, chunks=(256,), compression="gzip")
    src = _source(kind="hdf5", path=str(chunked), vocab_size=300)
    assert not isinstance(src._tokens, np.memmap)
    contiguous = _source(kind="hdf5", path=str(_token_file(tmp_path / "c.h5", tokens, 300)), vocab_size=300)
    np.testing.assert_array_equal(src.sample(1, 2)[0], contiguous.sample(1, 2)[0])
    with pytest.raises(ConfigError, match="model.vocab_size: 128"):
        _source(kind="hdf5", path=str(chunked), vocab_size=128)
    with pytest.raises(ConfigError, match="does not exist"):
        _source(kind="hdf5", path=str(tmp_path / "missing.h5"))


def test_from_config_builds_the_rank_source() -> None:
    cfg = config_mod.from_data({"trainer": {"n_gpus_per_node": 2}, "training": {"global_batch_size": 16,
                                                                                 "micro_batch_size": "auto"}})
    src = from_config(cfg, dp=2, dp_rank=1)
    assert (src.micro_batch, src.n_micro, list(src.samples)) == (4, 2, list(range(8, 16)))


# --- helpers -----------------------------------------------------------------------------------
def test_assemble_places_every_slice_at_its_offset() -> None:
    a = TensorSlice(name="w", global_shape=(2, 4), offset=(0, 0), shape=(2, 2), dtype="float32")
    b = TensorSlice(name="w", global_shape=(2, 4), offset=(0, 2), shape=(2, 2), dtype="float32")
    out = assemble([(a, np.ones((2, 2), np.float32)), (b, np.full((2, 2), 2, np.float32))])
    np.testing.assert_array_equal(out["w"], [[1, 1, 2, 2], [1, 1, 2, 2]])


def test_schedule_data_and_task_modules_load_without_torch() -> None:
    code = ("import sys, core.model.gpt.optim, core.model.gpt.data, core.model.gpt.task; "
            "print(sorted({'torch', 'megatron'} & {m.split('.')[0] for m in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


def test_auto_micro_batch_is_the_memory_formula_reduced_to_a_divisor() -> None:
    from core.config import run as config
    from core.config.plan import memory_per_sample, resolve_micro_batch

    cfg = config.from_data({"trainer": {"n_gpus_per_node": 2}, "training": {"micro_batch_size": "auto"}})
    per_sample = memory_per_sample(cfg)
    assert resolve_micro_batch(cfg, per_sample * 3 / 0.9 + 1) == 2  # floor(3) → largest divisor of 8 ≤ 3
    assert resolve_micro_batch(cfg, per_sample * 100) == 8
    assert resolve_micro_batch(cfg, 0) == 1
