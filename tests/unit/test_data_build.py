from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.data.build import build_dataset, token_dtype
from core.data.dataset import TokenDataset
from core.data.tokenizer import ByteTokenizer, load_tokenizer
from core.errors import UserError
from launcher import cmd_data

REPO = Path(__file__).resolve().parents[2]
TEXTS = [
    "Hello, world!\n",
    "héllo wörld — naïve café",
    "日本語のテキスト 🚀🧪 emoji + CJK",
    "e\u0301 combining, zero\u200bwidth, RTL שלום",
    "two paragraphs\n\nwith a blank line\r\nand CRLF\n\n",
    "",
]


def _decode_all(ds: TokenDataset) -> list[str]:
    tok = ByteTokenizer()
    out = []
    for i in range(ds.num_documents):
        ids = ds.document(i)
        assert ids[-1] == ds.eos_id  # every document ends with EOS
        out.append(tok.decode(ids[:-1]))
    return out


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=())))  # surrogates included
def test_byte_tokenizer_round_trips_any_string(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_id]) == text


def test_text_files_round_trip_one_document_per_file(tmp_path: Path) -> None:
    inputs = []
    for i, text in enumerate(TEXTS):
        path = tmp_path / f"doc{i}.txt"
        path.write_bytes(text.encode("utf-8"))
        inputs.append(path)
    out = tmp_path / "out" / "data.h5"
    stats = build_dataset(inputs, out)
    assert stats["documents"] == len(TEXTS)
    assert stats["tokens"] == sum(len(t.encode()) + 1 for t in TEXTS)
    assert stats["file_bytes"] == out.stat().st_size
    ds = TokenDataset(out)
    assert _decode_all(ds) == TEXTS
    assert sorted(p.name for p in out.parent.iterdir()) == ["data.h5"]  # no temporaries left


def test_jsonl_round_trips_including_lone_surrogates(tmp_path: Path) -> None:
    texts = [*TEXTS, "lone surrogate \ud800 survives"]
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"body": t, "id": i}) for i, t in enumerate(texts)]
    path.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n")  # blank line skipped
    out = tmp_path / "data.h5"
    build_dataset([path], out, text_key="body")
    assert _decode_all(TokenDataset(out)) == texts


def test_dataset_file_layout_and_memory_map(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "b.txt").write_text("de")
    out = tmp_path / "data.h5"
    build_dataset([tmp_path / "a.txt", tmp_path / "b.txt"], out)
    with h5py.File(out, "r") as f:
        assert f["tokens"].dtype == np.uint16 and f["tokens"].chunks is None
        assert f["doc_offsets"].dtype == np.int64
        assert list(f["doc_offsets"][()]) == [0, 4]
        assert dict(f.attrs) == {"vocab_size": 257, "tokenizer": "byte", "eos_id": 256,
                                      "format_version": 1, "documents": 2}
    ds = TokenDataset(out)
    assert isinstance(ds.tokens, np.memmap) and not ds.tokens.flags.writeable
    assert len(ds) == 7 and ds.vocab_size == 257
    assert list(ds.window(0, 4)) == [97, 98, 99, 256]
    assert list(ds.window(4, 3)) == [100, 101, 256]
    with pytest.raises(IndexError):
        ds.window(5, 3)


def test_folder_inputs_are_expanded_in_sorted_order(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_text("B")
    (src / "sub" / "c.jsonl").write_text('{"text": "C"}\n')
    (src / "a.txt").write_text("A")
    (src / "notes.md").write_text("ignored")
    build_dataset([src], tmp_path / "d.h5")
    assert _decode_all(TokenDataset(tmp_path / "d.h5")) == ["A", "B", "C"]


def test_vocab_above_16_bits_uses_uint32() -> None:
    assert token_dtype(257) == np.uint16 and token_dtype(65535) == np.uint16
    assert token_dtype(65536) == np.uint32


@pytest.mark.parametrize(
    "name, content, text_key, message",
    [
        ("bad.jsonl", '{"text": "ok"}\n{"text": oops}\n', "text", "bad.jsonl:2: not valid JSON"),
        ("key.jsonl", '{"text": "ok"}\n\n{"body": "x"}\n', "text", "key.jsonl:3: no field 'text' (fields: body); pass --text-key NAME"),
        ("list.jsonl", "[1, 2]\n", "text", "list.jsonl:1: expected a JSON object, got list"),
        ("num.jsonl", '{"text": 3}\n', "text", "num.jsonl:1: field 'text' is int, not a string"),
        ("data.csv", "a,b\n", "text", "data.csv: unknown extension '.csv'; supported: .txt, .jsonl, .parquet"),
        ("empty.jsonl", "\n\n", "text", "no documents in"),
    ],
)
def test_bad_inputs_are_one_line_user_errors_naming_the_file(tmp_path: Path, name: str, content: str,
                                                             text_key: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    out = tmp_path / "out.h5"
    with pytest.raises(UserError) as info:
        build_dataset([path], out, text_key=text_key)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing written, no temporaries


def test_missing_input_and_non_utf8_text_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"missing\.txt: no such file"):
        build_dataset([tmp_path / "missing.txt"], tmp_path / "o.h5")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1\.txt: not UTF-8 text"):
        build_dataset([tmp_path / "latin1.txt"], tmp_path / "o.h5")


def test_parquet_builds_when_pyarrow_is_installed_or_says_how_to_install(tmp_path: Path) -> None:
    path = tmp_path / "corpus.parquet"
    if importlib.util.find_spec("pyarrow") is None:
        path.write_bytes(b"PAR1")
        with pytest.raises(UserError, match=r"corpus\.parquet: reading \.parquet needs pyarrow; pip install pyarrow"):
            build_dataset([path], tmp_path / "o.h5")
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": TEXTS}), path)
    build_dataset([path], tmp_path / "o.h5")
    assert _decode_all(TokenDataset(tmp_path / "o.h5")) == TEXTS


def test_tokenizer_paths_are_local_only(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such file or folder; pass 'byte'"):
        load_tokenizer(tmp_path / "nope.json")
    fake = tmp_path / "tokenizer.json"
    fake.write_text("{}")
    if importlib.util.find_spec("tokenizers") is None:
        with pytest.raises(UserError, match="needs the tokenizers library; pip install tokenizers"):
            load_tokenizer(fake)
    else:
        with pytest.raises(UserError, match="not a valid tokenizer.json"):
            load_tokenizer(fake)


def test_token_dataset_rejects_chunked_and_foreign_files(tmp_path: Path) -> None:
    chunked = tmp_path / "chunked.h5"
    with h5py.File(chunked, "w") as f:
        f.create_dataset("tokens", data=np.arange(10, dtype=np.uint16), chunks=(5,))
        f.create_dataset("doc_offsets", data=np.zeros(1, dtype=np.int64))
        f.attrs.update({"vocab_size": 257, "eos_id": 256, "format_version": 1})
    with pytest.raises(UserError, match="not a contiguous 1-D dataset"):
        TokenDataset(chunked)
    (tmp_path / "plain.h5").write_text("not hdf5")
    with pytest.raises(UserError, match="plain.h5: not an HDF5 file"):
        TokenDataset(tmp_path / "plain.h5")
    with pytest.raises(UserError, match="no such token dataset"):
        TokenDataset(tmp_path / "absent.h5")


def test_module_entry_prints_stats_and_exits_2_on_bad_input(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello")
    ok = subprocess.run([sys.executable, "-m", "core.data.build", str(tmp_path / "a.txt"), "--output",
                         str(tmp_path / "d.h5")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "documents 1 from 1 file(s)" in ok.stdout and "tokens    6 (uint16" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "core.data.build", str(tmp_path / "x.csv"), "-o",
                          str(tmp_path / "e.h5")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [f"baton data build: error: {tmp_path / 'x.csv'}: no such file; check the path"]


def _data_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cmd_data.register(parser.add_subparsers())
    return parser.parse_args(["data", "build", *argv])


def test_launcher_data_build_runs_in_a_subprocess(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"t": "x"}\n')
    args = _data_args(str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "d.h5"), "--text-key", "t")
    assert cmd_data.build_command(args)[:3] == [sys.executable, "-m", "core.data.build"]
    assert cmd_data.run(args) == 0
    assert _decode_all(TokenDataset(tmp_path / "d.h5")) == ["x"]
    assert cmd_data.run(_data_args(str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "e.h5"))) == 2


def test_qwen3_tokenizer_is_offline_and_has_qwen3s_ids() -> None:
    tok = load_tokenizer("qwen3")
    assert tok.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert tok.encode("<|im_start|>user\nHi<|im_end|>") == [151644, 872, 198, 13048, 151645]
    assert tok.encode("<think>") == [151667] and tok.encode("</think>") == [151668]
    assert (tok.vocab_size, tok.eos_id) == (151669, 151643)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([*tok.encode("a"), 151643, 151645, *tok.encode("b")]) == "ab"  # specials skipped


def test_baton_data_build_with_the_qwen3_tokenizer(tmp_path: Path) -> None:
    src = tmp_path / "chat.jsonl"
    docs = ["<|im_start|>user\nWhat is 2+2?<|im_end|>", "Qwen3 thinks: <think>4</think>"]
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    res = subprocess.run([sys.executable, "-m", "launcher.cli", "data", "build", str(src), "-o", str(tmp_path / "q.h5"),
                          "--tokenizer", "qwen3"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr
    ds = TokenDataset(tmp_path / "q.h5")
    assert (ds.vocab_size, ds.eos_id, ds.tokenizer, ds.tokens.dtype) == (151669, 151643, "qwen3", np.uint32)
    tok = load_tokenizer("qwen3")
    assert [list(ds.document(i)) for i in range(2)] == [[*tok.encode(d), 151643] for d in docs]
