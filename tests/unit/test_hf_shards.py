"""The export's safetensors writer: bfloat16 rounded as torch rounds it, shards within their
limit under transformers' rule, an index that safetensors and transformers' loader read."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from core.hf import shards
from launcher.cmd_export import arg_size


def test_bfloat16_rounding_is_torchs_for_every_kind_of_value() -> None:
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, 3.3895314e38, 1e-45, -1e-40, 1.00390625,
                        1.01171875, 65504.0], np.float32)  # ties to even up and down, overflow to inf, subnormals
    values = np.concatenate([special, rng.standard_normal(100_000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 100_000)])
    values = values.astype(np.float32)
    got = shards.to_dtype(values, "bfloat16")
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert torch.from_numpy(got[~finite].view(np.int16)).view(torch.bfloat16).isnan().all()


def test_a_bfloat16_value_goes_through_float32_and_back_unchanged() -> None:
    words = np.arange(0, 2**16, dtype=np.uint32).astype(np.uint16)
    words = words[~np.isnan((words.astype(np.uint32) << 16).view(np.float32))]
    as_fp32 = (words.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(shards.to_dtype(as_fp32, "bfloat16"), words)


def test_shards_hold_at_most_the_limit_and_an_oversize_tensor_alone() -> None:
    tensors = [shards.Planned(f"t{i}", (n,)) for i, n in enumerate([100, 100, 300, 50, 1000, 10, 10])]
    plan = shards.plan_shards(tensors, "float32", 1600)  # 400 float32s
    assert [[t.name for t in s] for s in plan] == [["t0", "t1"], ["t2", "t3"], ["t4"], ["t5", "t6"]]
    assert [t for s in plan for t in s] == tensors


def test_written_shards_and_their_index_read_back(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    arrays = {f"model.layers.{i}.w": rng.standard_normal((64, 32)).astype(np.float32) for i in range(5)}
    planned = [shards.Planned(n, a.shape) for n, a in arrays.items()]
    plan = shards.plan_shards(planned, "bfloat16", 3 * 64 * 32 * 2)
    index = shards.write_shards(tmp_path, plan, "bfloat16",
                                lambda p: iter(np.split(shards.to_dtype(arrays[p.name], "bfloat16"), 4)))  # in blocks
    assert json.loads((tmp_path / shards.INDEX_NAME).read_text()) == index
    assert index["metadata"]["total_size"] == 5 * 64 * 32 * 2
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name, file in index["weight_map"].items():
        with safe_open(str(tmp_path / file), "pt") as f:
            got = f.get_tensor(name)
            assert f.metadata() == {"format": "pt"}
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, torch.from_numpy(arrays[name]).to(torch.bfloat16), rtol=0, atol=0)


def test_shard_sizes_are_read_as_transformers_reads_them() -> None:
    assert arg_size("5GB") == 5 * 10**9 and arg_size("500MB") == 5 * 10**8 and arg_size("2GiB") == 2 * 2**30
    assert arg_size("1000") == 1000
