"""``program: sft``'s input: the sft section, conversations read and tokenized (core.data.sft),
rows and their loss mask (core.model.gpt.data.SFTSource), and the refusals of bad input, one
line on the login node before anything is written."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from core.config import run as config_mod
from core.data.sft import ByteChat, ConversationFileError, load, read_conversations
from core.errors import ConfigError
from core.model.gpt.data import SFTSource, from_config
from tests.helpers import REPO, baton

CHAT = REPO / "experiments" / "data" / "chat_count.jsonl"
TALK = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "?"}, {"role": "assistant", "content": "ok"}]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sft_config(data: Path, **more: object) -> dict:
    return {"program": "sft", "sft": {"data": str(data), "tokenizer": "byte"},
            "model": {"kind": "gpt", "vocab_size": 264, "seq_length": 128},
            "training": {"global_batch_size": 8, "micro_batch_size": 2}, **more}


def test_the_byte_chat_marks_the_assistants_content_and_its_end_of_turn() -> None:
    ids, mask = ByteChat().sft_ids(TALK)
    want_ids, want_mask = [], []
    for m in TALK:  # written out independently: header, content, EOS
        head, body = list(f"<|{m['role']}|>\n".encode()), list(m["content"].encode()) + [256]
        want_ids += head + body
        want_mask += [0] * len(head) + [m["role"] == "assistant"] * len(body)
    assert ids == want_ids and mask == [int(v) for v in want_mask]
    assert bytes(i for i, k in zip(ids, mask, strict=True) if k and i < 256) == b"yook"


def test_rows_are_right_padded_and_only_assistant_labels_count() -> None:
    conv = read_conversations(CHAT, key="messages", tokenizer=ByteChat(), seq_length=128)
    src = SFTSource(conv, seed=5, seq_length=128, global_batch=8, micro_batch=2, dp=1, dp_rank=0)
    for i in range(8):
        tokens, labels, keep = src.sample(3, i)
        c = src.conversation(3, i)
        ids, mask = conv.ids[c], conv.masks[c]
        n = len(ids)
        assert tokens.shape == labels.shape == keep.shape == (128,)
        assert list(tokens[:n - 1]) == list(ids[:-1]) and list(labels[:n - 1]) == list(ids[1:])
        assert list(keep[:n - 1]) == list(mask[1:])  # label t counts when the assistant wrote id t + 1
        assert not keep[n - 1:].any() and (tokens[n:] == 256).all() and (labels[n - 1:] == 256).all()
    mbs = src.micro_batches(3)
    assert [mb.tokens.shape for mb in mbs] == [(2, 128)] * 4
    counted = sum(int(conv.masks[src.conversation(3, i)][1:].sum()) for i in range(8))
    assert {mb.loss_tokens for mb in mbs} == {counted} == {sum(int(mb.loss_mask.sum()) for mb in mbs)}


def test_the_order_is_a_function_of_seed_and_step_each_conversation_once_per_epoch() -> None:
    conv = read_conversations(CHAT, key="messages", tokenizer=ByteChat(), seq_length=128)
    n = len(conv)
    src = SFTSource(conv, seed=5, seq_length=128, global_batch=8, micro_batch=2, dp=1, dp_rank=0)
    order = [src.conversation(s, i) for s in range(2 * n // 8) for i in range(8)]
    assert Counter(order[:n]) == Counter(order[n:]) == Counter(range(n)) and order[:n] != order[n:]
    again = SFTSource(conv, seed=5, seq_length=128, global_batch=8, micro_batch=2, dp=1, dp_rank=0)
    assert [again.conversation(7, i) for i in range(8)] == order[56:64]  # a resumed run reads the same
    other = SFTSource(conv, seed=6, seq_length=128, global_batch=8, micro_batch=2, dp=1, dp_rank=0)
    assert [other.conversation(0, i) for i in range(8)] != order[:8]


def test_data_parallel_ranks_split_the_same_global_batch(tmp_path: Path) -> None:
    cfg = config_mod.from_data(_sft_config(CHAT))
    whole = from_config(cfg, dp=1, dp_rank=0).micro_batches(4)
    parts = [mb for r in range(2) for mb in from_config(cfg, dp=2, dp_rank=r).micro_batches(4)]
    for name in ("tokens", "labels", "loss_mask"):
        assert np.array_equal(np.concatenate([getattr(m, name) for m in whole]),
                              np.concatenate([getattr(m, name) for m in parts]))
    assert {m.loss_tokens for m in whole + parts} == {whole[0].loss_tokens}


def test_the_run_folder_keeps_the_conversations_submit_read(tmp_path: Path) -> None:
    from launcher import runprep  # the login node's preparation of a run folder

    cfg = config_mod.load(REPO / "experiments" / "sft_chat.yaml", [f"runs_root={tmp_path}"])
    run = runprep.prepare_run(cfg, backend="local")
    frozen = load(run.path / "sft_data.npz")
    read = read_conversations(CHAT, key="messages", tokenizer=ByteChat(), seq_length=128)
    assert frozen.where == read.where and (frozen.eos_id, frozen.vocab_size) == (256, 257)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(frozen.ids + frozen.masks,
                                                                       read.ids + read.masks, strict=True))
    batches = from_config(cfg, dp=2, dp_rank=1, run_dir=run.path).micro_batches(2)  # the workers' source
    assert [m.tokens.shape for m in batches] == [(4, 128)] * 2


@pytest.mark.parametrize(("rows", "message"), [
    ([{"messages": TALK}, {"text": "x"}], r"c.jsonl:2: no field 'messages' \(fields: text\); set sft.messages_key"),
    ([{"messages": "hello"}], r"c.jsonl:1: 'messages' is str, not a conversation; each record's"),
    ([{"messages": []}], r"c.jsonl:1: 'messages' is list \(empty\), not a conversation"),
    ([{"messages": [{"role": "user"}]}], r"c.jsonl:1: message 0 of 'messages' is not a \{role, content\} message"),
    ([{"messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "y"}]}],
     r"c.jsonl:1: the conversation is 226 tokens > model.seq_length \+ 1 = 129; raise model.seq_length"),
    ([{"messages": TALK[:2]}], r"c.jsonl:1: no assistant token to learn from \(no assistant turn\)"),
    ([], r"c.jsonl: holds no conversation to train on"),
])
def test_bad_conversation_files_are_one_line_naming_the_record(tmp_path: Path, rows: list, message: str) -> None:
    with pytest.raises(ConversationFileError, match=message) as err:
        read_conversations(_jsonl(tmp_path / "c.jsonl", rows), key="messages", tokenizer=ByteChat(), seq_length=128)
    assert str(err.value).startswith("sft.data: ") and "\n" not in str(err.value)


def test_too_long_conversations_can_be_dropped_or_cut(tmp_path: Path) -> None:
    long = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y" * 300}]
    f = _jsonl(tmp_path / "c.jsonl", [{"messages": TALK}, {"messages": long}])
    dropped = read_conversations(f, key="messages", tokenizer=ByteChat(), seq_length=128, too_long="drop")
    assert len(dropped) == 1 and dropped.dropped == 1 and dropped.where == [f"{f}:1"]
    cut = read_conversations(f, key="messages", tokenizer=ByteChat(), seq_length=128, too_long="truncate")
    assert [len(i) for i in cut.ids] == [len(ByteChat().sft_ids(TALK)[0]), 129] and cut.masks[1][-1]


@pytest.mark.parametrize(("more", "message"), [
    ({"sft": {"tokenizer": "byte"}}, r"sft.data: program: sft needs a .jsonl or .parquet file"),
    ({"sft": {"data": "nope.jsonl", "tokenizer": "byte"}}, r"sft.data: 'nope.jsonl' does not exist"),
    ({"sft": {"data": str(CHAT)}}, r"sft.tokenizer: 'hf' reads the tokenizer of init_from: hf:FOLDER, but init_from "
                                   r"is None"),
    ({"sft": {"data": str(CHAT), "tokenizer": "/no/such/tok"}}, r"sft.tokenizer: '/no/such/tok' is neither byte"),
    ({"program": "pretrain"}, r"sft: read only with program: sft \(now 'pretrain'\)"),
    ({"generator": {"enabled": True}}, r"program: sft trains a GPT without a generator"),
])
def test_the_sft_section_is_checked_with_the_config(more: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_mod.from_data({**_sft_config(CHAT), **more})


@pytest.mark.parametrize(("rows", "message"), [
    (None, "sft.data: 'missing.jsonl' does not exist"),
    ([{"msgs": TALK}], "c.jsonl:1: no field 'messages' (fields: msgs)"),
    ([{"messages": TALK}, {"messages": {"role": "user"}}], "c.jsonl:2: 'messages' is dict, not a conversation"),
    ([{"messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "y"}]}],
     "c.jsonl:1: the conversation is 226 tokens > model.seq_length + 1 = 129"),
])
def test_submit_refuses_bad_chat_data_in_one_line_before_writing(tmp_path: Path, rows: list | None,
                                                                 message: str) -> None:
    data = "missing.jsonl" if rows is None else str(_jsonl(tmp_path / "c.jsonl", rows))
    res = baton("submit", "experiments/sft_chat.yaml", f"runs_root={tmp_path}/runs", f"sft.data={data}",
                "--backend", "local", timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "sft.data" in lines[0], res.stderr
    assert not (tmp_path / "runs").exists()


# --- a Hugging Face tokenizer folder's chat template (tests/hf_tokenizers.py) -----------------------
@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.hf_tokenizers import chatml_folder  # transformers: only these tests build a folder

    return chatml_folder(tmp_path_factory.mktemp("chatml"))


def test_with_a_tokenizer_folder_the_counted_labels_are_the_assistants_turns(chatml: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer  # the independent reference

    f = _jsonl(tmp_path / "c.jsonl", [{"messages": TALK}])
    cfg = config_mod.from_data(_sft_config(f, sft={"data": str(f), "tokenizer": str(chatml)},
                                           model={"kind": "gpt", "vocab_size": 512, "seq_length": 128}))
    mb = from_config(cfg, dp=1, dp_rank=0).micro_batches(0)[0]
    hf = AutoTokenizer.from_pretrained(str(chatml), local_files_only=True)
    whole = hf.apply_chat_template(TALK, tokenize=True, return_dict=True)["input_ids"]
    n = len(whole)
    assert list(mb.tokens[0, :n - 1]) == whole[:-1] and (mb.tokens[0, n:] == hf.eos_token_id).all()
    # what generation produces after each generation prompt: the content and its stop token (not the newline after)
    assert hf.decode(mb.labels[0][mb.loss_mask[0]]) == "yo<|im_end|>ok<|im_end|>"
    assert mb.loss_tokens == int(mb.loss_mask.sum()) * 4  # the global batch: 8 rows of the one conversation, 2 here


def test_a_model_vocabulary_smaller_than_the_tokenizers_is_refused_at_submit(chatml: Path) -> None:
    from transformers import AutoTokenizer  # the reference: the folder's tokens, added ones included

    size = len(AutoTokenizer.from_pretrained(str(chatml), local_files_only=True))
    res = baton("submit", "experiments/sft_chat.yaml", "runs_root=/nonexistent/runs", f"sft.tokenizer={chatml}",
                "--backend", "local", timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip() == (f"baton: error: sft.tokenizer: {chatml} has {size} tokens > model.vocab_size = "
                                  f"264; raise model.vocab_size to at least {size}"), res.stderr


def test_chat_template_variables_reach_the_template(tmp_path: Path) -> None:
    """Qwen3's ``enable_thinking: false`` puts the empty think block into the generation prompt:
    the assistant's labels are then its answer alone, not the think block the template writes."""
    from transformers import AutoTokenizer  # the independent reference

    from tests.hf_tokenizers import qwen3_folder

    folder = qwen3_folder(tmp_path / "qwen3")
    talk = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    f = _jsonl(tmp_path / "c.jsonl", [{"messages": talk}])
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    learned = {}
    for thinking in (False, None):
        sft = {"data": str(f), "tokenizer": str(folder)}
        if thinking is not None:
            sft["chat_template_kwargs"] = {"enable_thinking": thinking}
        cfg = config_mod.from_data(_sft_config(f, sft=sft, model={"kind": "gpt", "vocab_size": 512, "seq_length": 128}))
        mb = from_config(cfg, dp=1, dp_rank=0).micro_batches(0)[0]
        learned[thinking] = hf.decode(mb.labels[0][mb.loss_mask[0]])
    assert learned[False] == "yo<|im_end|>"
    assert learned[None] == "<think>\n\n</think>\n\nyo<|im_end|>"


def test_the_byte_chat_takes_no_template_variables(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sft.chat_template_kwargs: the byte tokenizer has no chat template"):
        config_mod.from_data(_sft_config(CHAT, sft={"data": str(CHAT), "tokenizer": "byte",
                                                    "chat_template_kwargs": {"enable_thinking": False}}))


def test_a_parquet_file_gives_the_same_conversations_as_its_jsonl(tmp_path: Path) -> None:
    import pyarrow as pa  # tests only: Parquet's writer
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in CHAT.read_text().splitlines() if line.strip()][:6]
    jsonl = _jsonl(tmp_path / "c.jsonl", records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "c.parquet")
    a = read_conversations(jsonl, key="messages", tokenizer=ByteChat(), seq_length=128)
    b = read_conversations(tmp_path / "c.parquet", key="messages", tokenizer=ByteChat(), seq_length=128)
    assert len(a) == len(b) == 6
    assert all(np.array_equal(x, y) for x, y in zip(a.ids + a.masks, b.ids + b.masks, strict=True))
