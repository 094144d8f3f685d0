"""An RL run's bad inputs, tried as a new user would (issue 31's list): each refused by
``baton submit`` on the login node in one line naming the key and the file, exit 2, before
any run folder is written. (A reward module that cannot be loaded: tests/unit/test_rewards.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import refused_at_submit

GRPO = Path(__file__).resolve().parents[2] / "experiments" / "grpo_tiny.yaml"
FILE_TASK = ("rl.task=file", "model.vocab_size=300", "rl.prompt_length=8")

PROMPT_FILES = [  # (file name, its bytes, what the one line says after "rl.prompts: FILE")
    ("empty.jsonl", b"", ": holds no prompt; give a file with at least one record"),
    ("latin1.jsonl", b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n', ":2: not a UTF-8 JSON object"),
    ("broken.jsonl", b'{"prompt": "ok"}\n{"prompt": "no end\n', ":2: not a UTF-8 JSON object"),
    ("array.jsonl", b'["prompt", "ok"]\n', ":1: expected a JSON object, got list"),
    ("other.jsonl", b'{"question": "ok"}\n', ":1: no field 'prompt' (fields: question); set rl.prompt_key"),
    ("number.jsonl", b'{"prompt": 12}\n', ":1: field 'prompt' is int, neither text nor chat messages"),
    ("prompts.csv", b"prompt\nok\n", ": unknown extension '.csv'; give a .jsonl or .parquet file"),
    ("long.jsonl", b'{"prompt": "ok"}\n{"prompt": "far too long for eight"}\n',
     ":2: the prompt is 22 tokens > rl.prompt_length = 8"),
]


def _refused(tmp_path: Path, *overrides: str) -> str:
    return refused_at_submit(tmp_path, GRPO, *overrides)


@pytest.mark.parametrize(("name", "raw", "says"), PROMPT_FILES, ids=[p[0] for p in PROMPT_FILES])
def test_a_bad_prompts_file_is_refused_at_submit_naming_the_file_and_the_record(
        tmp_path: Path, name: str, raw: bytes, says: str) -> None:
    path = tmp_path / name
    path.write_bytes(raw)
    line = _refused(tmp_path, *FILE_TASK, f"rl.prompts={path}")
    assert line.startswith(f"rl.prompts: {path}{says}"), line


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n")
    return path


@pytest.mark.parametrize(("kind", "says"), [
    ("text", "is not a readable tokenizer.json (Expecting value"),
    ("other_json", "holds no vocabulary; give a tokenizer.json saved by a fast tokenizer"),
    ("bpe_without_merges", "not a valid tokenizer.json (Missing vocab/merges"),
    ("empty_folder", "does not exist; give a Hugging Face folder with its tokenizer.json"),
])
def test_a_tokenizer_that_is_not_one_is_refused_naming_rl_tokenizer(tmp_path: Path, kind: str, says: str) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    target = {"text": folder / "tokenizer.json", "other_json": folder / "tokenizer.json",
              "bpe_without_merges": folder, "empty_folder": folder}[kind]
    body = {"text": "not json at all", "other_json": '{"a": 1}',
            "bpe_without_merges": json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}})}.get(kind)
    if body is not None:
        (folder / "tokenizer.json").write_text(body)
    line = _refused(tmp_path, *FILE_TASK, f"rl.prompts={_prompts(tmp_path)}", f"rl.tokenizer={target}")
    assert line.startswith("rl.tokenizer: ") and str(folder) in line and says in line, line
    assert "pip install" not in line, line


@pytest.mark.parametrize(("overrides", "says"), [
    (("rl.n=1", "rl.prompts_per_step=8"), "rl.n: 1 under program: grpo leaves each prompt a group of one response"),
    (("rl.stop=[256, 300]",), "rl.stop: 300 not an id of byte (0..256); give ids below its vocabulary"),
    (("rl.stop=[-1]",), "rl.stop: -1 not an id of byte (0..256)"),
])
def test_a_group_of_one_and_a_stop_id_outside_the_vocabulary_are_refused_at_submit(
        tmp_path: Path, overrides: tuple[str, ...], says: str) -> None:
    file_task = (*FILE_TASK, f"rl.prompts={_prompts(tmp_path)}") if any("stop" in o for o in overrides) else ()
    line = _refused(tmp_path, *file_task, *overrides)
    assert line.startswith(says), line


def test_an_end_of_text_id_outside_the_tokenizers_vocabulary_is_refused_naming_rl_tokenizer(tmp_path: Path) -> None:
    from tests.hf_tokenizers import chatml_folder  # a small real Hugging Face tokenizer folder

    folder = chatml_folder(tmp_path / "tok")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 10**6]}))
    line = _refused(tmp_path, *FILE_TASK, f"rl.prompts={_prompts(tmp_path)}", f"rl.tokenizer={folder}",
                    "model.vocab_size=512")
    assert line.startswith("rl.tokenizer: ") and "generation_config.json: eos_token_id [2, 1000000] is not an id" in line
