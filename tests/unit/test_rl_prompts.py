"""Prompts from a file (core.data.prompts) and the epoch cursor over them (core.rl.tasks)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from core.data.prompts import PromptFileError, read_prompts
from core.data.tokenizer import ByteTokenizer, load_tokenizer
from core.rl import tasks


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompts_are_tokenized_left_padded_with_end_of_text_and_keep_their_metadata(tmp_path: Path) -> None:
    f = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "10+5=", "answer": "15"}])
    got = read_prompts(f, key="prompt", tokenizer=ByteTokenizer(), length=6)
    assert [p.tokens for p in got] == [(256, 256, 49, 43, 49, 61), (256, 49, 48, 43, 53, 61)]
    assert [p.pad for p in got] == [2, 1]  # the RL calls mask these out
    assert got[1].meta == {"answer": "15", "prompt_text": "10+5="}


def test_qwen3_prompts_are_padded_with_qwen3s_end_of_text(tmp_path: Path) -> None:
    f = _jsonl(tmp_path / "p.jsonl", [{"q": "Hello, world!"}])
    (p,) = read_prompts(f, key="q", tokenizer=load_tokenizer("qwen3"), length=6)
    assert p.tokens == (151643, 151643, 9707, 11, 1879, 0)


@pytest.mark.parametrize(("rows", "length", "message"), [
    ([{"prompt": "a much longer prompt"}], 4, r"p.jsonl:1: the prompt is 20 tokens > rl.prompt_length = 4; raise "),
    ([{"prompt": "ok"}, {"text": "x"}], 4, r"p.jsonl:2: no field 'prompt' \(fields: text\); set rl.prompt_key"),
    ([], 4, r"p.jsonl: holds no prompt"),
])
def test_bad_prompt_files_are_one_line_naming_the_record(tmp_path: Path, rows: list, length: int, message: str) -> None:
    with pytest.raises(PromptFileError, match=message) as err:
        read_prompts(_jsonl(tmp_path / "p.jsonl", rows), key="prompt", tokenizer=ByteTokenizer(), length=length)
    assert str(err.value).startswith("rl.prompts: ") and "\n" not in str(err.value)
    with pytest.raises(PromptFileError, match=r"unknown extension '.csv'"):
        read_prompts(tmp_path / "p.csv", key="prompt", tokenizer=ByteTokenizer(), length=4)


def test_the_cursor_asks_every_prompt_once_per_epoch_and_is_a_function_of_the_step(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}"} for i in range(6)]
    prompts = read_prompts(_jsonl(tmp_path / "p.jsonl", rows), key="prompt", tokenizer=ByteTokenizer(), length=4)
    asked = [a.meta for step in range(4) for a in tasks.from_file(prompts, 1234, step, 3)]
    assert [m["epoch"] for m in asked] == [0] * 6 + [1] * 6
    for epoch in (0, 1):
        assert Counter(m["prompt_text"] for m in asked if m["epoch"] == epoch) == Counter(r["prompt"] for r in rows)
    assert [m["prompt_text"] for m in asked[:6]] != [m["prompt_text"] for m in asked[6:]]  # each epoch its own order
    assert tasks.from_file(prompts, 1234, 3, 3) == tasks.from_file(prompts, 1234, 3, 3)  # a resume asks the same


@pytest.mark.parametrize("backend", [["--backend", "local"], ["--backend", "slurm", "--dry-run"]])
def test_submit_reads_the_prompts_and_refuses_a_bad_one_before_writing(tmp_path: Path, backend: list[str]) -> None:
    """The controller would refuse it at the job's start; the login node refuses it first."""
    from tests.helpers import baton  # the real CLI in a subprocess

    exp = Path(__file__).resolve().parents[2] / "experiments" / "grpo_tiny.yaml"
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "' + "x" * 40 + '"}\n')
    res = baton("submit", str(exp), *backend, f"runs_root={tmp_path / 'runs'}", "rl.task=file",
                f"rl.prompts={bad}", "model.vocab_size=257", "rl.prompt_length=8", cwd=tmp_path, timeout=120)
    line = res.stderr.strip()
    assert res.returncode == 2 and "\n" not in line, res.stderr
    assert f"{bad}:2" in line and "rl.prompt_length = 8" in line, line
    assert not (tmp_path / "runs").exists()


def test_submit_refuses_a_bad_validation_prompt_naming_rl_val_prompts_before_writing(tmp_path: Path) -> None:
    from tests.helpers import baton  # the real CLI in a subprocess

    exp = Path(__file__).resolve().parents[2] / "experiments" / "grpo_tiny.yaml"
    good, bad = _jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}]), tmp_path / "v.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"question": "no prompt field"}\n')
    res = baton("submit", str(exp), "--backend", "local", f"runs_root={tmp_path / 'runs'}", "rl.task=file",
                f"rl.prompts={good}", f"rl.val_prompts={bad}", "rl.val_every=2", "model.vocab_size=257",
                "rl.prompt_length=8", cwd=tmp_path, timeout=120)
    line = res.stderr.strip()
    assert res.returncode == 2 and "\n" not in line, res.stderr
    assert line == f"baton: error: rl.val_prompts: {bad}:2: no field 'prompt' (fields: question); set rl.prompt_key " \
        "to the field that holds the prompt", line
    assert not (tmp_path / "runs").exists()


def test_the_counting_task_s_held_out_prompts_come_from_a_key_no_training_step_draws() -> None:
    """With a vocabulary of 2**31 a shared key would repeat a training prompt exactly; none of
    the first 2000 training steps' prompts is a held-out one, and the set is fixed per seed."""
    vocab = 2**31
    held = tasks.counting_held_out(1234, 8, 4, vocab)
    assert held == tasks.counting_held_out(1234, 8, 4, vocab) and held != tasks.counting_held_out(1235, 8, 4, vocab)
    assert all(a.tokens == tuple((a.tokens[0] + k) % vocab for k in range(4)) for a in held)
    assert [a.meta for a in held] == [{"vocab_size": vocab, "index": i} for i in range(8)]
    trained = {a.tokens for step in range(2000) for a in tasks.counting(1234, step, 8, 4, vocab)}
    assert len(trained) == 2000 * 8 and not trained & {a.tokens for a in held}
