"""The Megatron engine's decoding at real-length settings, on real Megatron-core ranks.

Two ranks (tests/integration/gpt_harness.py): a tp1 trainer (two data-parallel replicas, each a
whole model) and a tp2 generator colocated with it, synced from it (the same global weights,
trained a few steps so that the logits are far from flat). The references:

- greedy: a plain loop that runs the whole sequence forward again for every token (no KV
  cache, the full vocabulary gathered) and takes the argmax, on the trainer's tp1 model;
- the rollout at tp2 beside the same decode at tp1 (the trainer's model): tp changes only
  the order of the logits' fp32 sums, so the tokens agree and the log-probs within 1e-5;
- the sampler split over the tp2 group beside the same choice over the whole vocabulary on
  one rank, for the same logits: the same tokens;
- chunks of 1, 2 and 5 rows, prefills shared by a prompt's samples or not, and ended rows
  leaving the batch or not, beside one chunk of every row: the same tokens, and log-probs
  within 1e-6 (another batch size may round the last bit of a sum on this CPU's kernels);
  the distributions themselves: tests/unit/test_device_sampling.py.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from core.flows import calls as gen_calls
from tests.helpers import as_rows, ints
from tests.integration.gpt_harness import RankGroup, gpt_config, greedy_reference, sync_generator

pytestmark = [pytest.mark.megatron, pytest.mark.slow, pytest.mark.timeout(600)]
N, NEW, PAD = 6, 10, 127  # prompt length (left-padded), new tokens, the pad id
ROW = N + NEW
_rng = np.random.default_rng(11)
REAL = [tuple(int(t) for t in _rng.integers(0, 120, k)) for k in (6, 4, 6, 5)]
ORDER = (0, 1, 0, 2, 3, 1, 2, 0, 3, 1, 2, 3)  # 3 samples of each prompt, interleaved
PROMPTS = [(PAD,) * (N - len(REAL[i])) + REAL[i] for i in ORDER]
PADS = [N - len(REAL[i]) for i in ORDER]
SEEDS = [1000 + 7 * r for r in range(len(ORDER))]
SAMPLED = {"temperature": 1.0, "top_k": 40, "top_p": 0.9}


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cfg = gpt_config(world_size=2, generator={"enabled": True, "tp": 2, "max_batch_tokens": 5 * ROW})
    with RankGroup(cfg, world_size=2, run_dir=tmp_path_factory.mktemp("decode")) as g:
        g.setup()
        g.train(range(4))
        sync_generator(g, version=4)
        yield g


def _model(task: Any, which: str) -> Any:
    if which == "rollout":
        return task.role("rollout").model.model
    from core.model.gpt.model import unwrap

    model = unwrap(task.role("actor").rank.ready().model_chunks[0])
    model.eval()
    return model


def decode_on_rank(task: Any, *, which: str, how: dict[str, Any], prompts: list[Any] = PROMPTS,
                   pads: list[int] = PADS, max_batch_tokens: int | None = None, share: bool = True,
                   compact: bool = True) -> dict[str, Any]:
    """core.model.gpt.generate.decode on this rank's ``which`` model, the rows of each forward recorded."""
    from core.model.gpt.generate import Sampling, decode

    model = _model(task, which)
    rows: list[int] = []
    hook = model.register_forward_hook(lambda _m, args, _out: rows.append(int(args[0].shape[0])))
    try:
        out = decode(model, prompts, Sampling(max_new_tokens=NEW, **how), seeds=SEEDS[:len(prompts)], max_length=32,
                     pads=pads, max_batch_tokens=max_batch_tokens, share_prefill=share, compact=compact)
    finally:
        hook.remove()
    return {"tokens": out.tokens, "logprobs": out.logprobs, "kv": out.kv_cache_bytes, "forwards": len(rows),
            "rows": rows}


def plain_greedy_on_rank(task: Any, prompts: list[tuple[int, ...]]) -> list[list[int]]:
    """The reference: the whole sequence forward again for every token, the argmax of the gathered logits."""
    return greedy_reference(_model(task, "actor"), prompts, NEW)


def split_sampler_on_rank(task: Any) -> list[tuple[list[int], list[int], float]]:
    """For each way of sampling: the tokens chosen over the tp2 group's slices of some logits,
    those chosen over the whole vocabulary here, and the largest log-prob gap."""
    import torch
    import torch.distributed as dist

    from core.model.gpt import sampling

    group = task.role("rollout").model.model.pg_collection.tp
    logits = torch.randn(256, 128, generator=torch.Generator().manual_seed(5)) * 3
    logits[:, 70] = logits[:, 3]  # a tie across the slices: the lowest id wins
    part = 128 // dist.get_world_size(group)
    lo = dist.get_rank(group) * part
    keys = sampling.row_keys(range(256), logits.device)
    out = []
    for how in ({}, {"temperature": 1.0}, {"temperature": 0.8, "top_k": 20}, {"temperature": 1.0, "top_p": 0.7},
                {"temperature": 1.2, "top_k": 50, "top_p": 0.8}):
        spec = sampling.Sampling(max_new_tokens=1, **how)
        split, lp_split = sampling.choose(logits[:, lo:lo + part].contiguous(), spec, keys=keys, step=9, lo=lo,
                                          group=group)
        whole, lp_whole = sampling.choose(logits, spec, keys=keys, step=9, lo=0, group=None)
        out.append((split.tolist(), whole.tolist(), float((lp_split - lp_whole).abs().max())))
    return out


def test_greedy_equals_a_full_forward_argmax_loop_at_tp1_and_tp2(group: RankGroup) -> None:
    reals = [REAL[0], REAL[2]]  # unpadded prompts: the reference loop has no pad mask
    plain = group.apply(plain_greedy_on_rank, prompts=reals)[0]
    tp1 = group.apply(decode_on_rank, which="actor", how={}, prompts=reals, pads=[])[0]
    tp2 = group.apply(decode_on_rank, which="rollout", how={}, prompts=reals, pads=[])
    assert tp1["tokens"] == plain
    assert tp2[0]["tokens"] == tp2[1]["tokens"] == plain  # every tp rank returns the same
    assert tp1["forwards"] == NEW  # a prefill and NEW - 1 decode steps


def test_samples_do_not_depend_on_the_chunks_nor_on_shared_prefills(group: RankGroup) -> None:
    one = group.apply(decode_on_rank, which="rollout", how=SAMPLED)[0]
    assert one["forwards"] == NEW  # 4 distinct prompts prefilled in one forward, then 9 decode steps
    for budget in (ROW, 2 * ROW + 3, 5 * ROW):
        for share in (True, False):
            got = group.apply(decode_on_rank, which="rollout", how=SAMPLED, max_batch_tokens=budget, share=share)[0]
            assert got["tokens"] == one["tokens"], (budget, share)
            assert np.abs(np.subtract(got["logprobs"], one["logprobs"])).max() <= 1e-6, (budget, share)
    # the samples of a prompt, sharing its prefill, are drawn each by its own key
    assert len({tuple(one["tokens"][r]) for r in range(len(ORDER)) if ORDER[r] == 0}) == 3


def test_the_kv_cache_is_one_chunk_of_max_batch_tokens(group: RankGroup) -> None:
    got = group.apply(decode_on_rank, which="rollout", how={}, max_batch_tokens=5 * ROW)[0]
    per_row = 4 * 2 * ROW * 2 * 16 * 4  # layers × (key, value) × positions × kv heads on this rank × head dim × fp32
    assert got["kv"] == 5 * per_row
    assert got["forwards"] == 3 * NEW  # chunks of 5, 5 and 2 rows
    req = gen_calls.GENERATE.encode_request(gen_calls.Generate(prompts=ints(PROMPTS), max_new_tokens=NEW,
                                                               pads=tuple(PADS)))
    (answer,) = [as_rows(r) for r in group.call("generate", **req) if r.get("replica", -1) >= 0]
    assert answer["kv_cache_bytes"] == 5 * per_row  # generator.max_batch_tokens = 5 rows
    assert [list(t) for t in answer["tokens"]] == got["tokens"]


def test_tp2_samples_what_tp1_samples(group: RankGroup) -> None:
    tp1 = group.apply(decode_on_rank, which="actor", how=SAMPLED)[0]
    tp2 = group.apply(decode_on_rank, which="rollout", how=SAMPLED)[0]
    assert tp1["tokens"] == tp2["tokens"]
    assert np.abs(np.subtract(tp1["logprobs"], tp2["logprobs"])).max() <= 1e-5
    for split, whole, gap in group.apply(split_sampler_on_rank)[0]:
        assert split == whole and gap <= 1e-6


def test_decoding_ends_when_every_row_has_ended(group: RankGroup) -> None:
    free = group.apply(decode_on_rank, which="rollout", how=SAMPLED)[0]
    eos = tuple(sorted({row[2] for row in free["tokens"]}))  # every row ends by its third token
    ended = group.apply(decode_on_rank, which="rollout", how={**SAMPLED, "eos": eos})[0]
    assert ended["forwards"] == 3 and ended["rows"][:2] == [4, 12]  # 4 distinct prompts' prefill, then every row
    for row, ref, logp in zip(ended["tokens"], free["tokens"], ended["logprobs"], strict=True):
        stop = next(i for i, t in enumerate(ref) if t in eos)
        assert row[:stop + 1] == ref[:stop + 1] and row[stop + 1:] == [eos[0]] * (NEW - stop - 1)
        assert logp[stop + 1:] == [0.0] * (NEW - stop - 1) and all(lp < 0 for lp in logp[:stop + 1])


def test_ended_rows_leave_the_batch_and_the_others_draw_the_same(group: RankGroup) -> None:
    free = group.apply(decode_on_rank, which="rollout", how=SAMPLED)[0]
    eos = tuple(sorted({free["tokens"][r][3] for r in range(8)}))  # 8 of the 12 rows end by their 4th token
    stops = [next((i for i, t in enumerate(row) if t in eos), None) for row in free["tokens"]]
    kept = group.apply(decode_on_rank, which="rollout", how={**SAMPLED, "eos": eos}, compact=False)[0]
    both = group.apply(decode_on_rank, which="rollout", how={**SAMPLED, "eos": eos})
    for got in both:  # every tp rank alike; a smaller batch may round the last bit of a sum otherwise
        assert got["tokens"] == kept["tokens"]
        assert np.abs(np.subtract(got["logprobs"], kept["logprobs"])).max() <= 1e-6
    for row, ref, stop in zip(kept["tokens"], free["tokens"], stops, strict=True):
        assert row == (ref if stop is None else ref[:stop + 1] + [eos[0]] * (NEW - stop - 1))
    shrunk = both[0]["rows"]
    assert kept["rows"] == [4] + [12] * (len(kept["rows"]) - 1)  # the prefill: 4 distinct prompts
    assert shrunk[1] == 12 and shrunk[-1] <= 4 and shrunk[1:] == sorted(shrunk[1:], reverse=True), shrunk
