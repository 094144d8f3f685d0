"""GRPO on the local backend with a Hugging Face tokenizer folder: chat-message prompts reach
the policy as the chat template's ids (transformers' apply_chat_template with the generation
prompt, left-padded), responses stop at the first of the ``rl.stop`` ids, and the reward's
``response_text`` is transformers' decode of the response before its stop token."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.helpers import baton
from tests.hf_tokenizers import chatml_folder

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REWARD = '''
import json, os


def log_text(prompt, response, meta):
    with open(os.environ["PROMPT_LOG"], "a") as f:
        f.write(json.dumps({"prompt": list(prompt), "prompt_text": meta["prompt_text"], "messages": meta["messages"],
                            "response": list(response), "text": meta["response_text"]}) + "\\n")
    return float(len(meta["response_text"]) % 2)
'''
CHATS = [
    [{"role": "user", "content": "What is two plus two?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "héllo wörld 你好 🎉"}],
]


def test_grpo_with_chat_prompts_and_stop_tokens_of_a_hugging_face_folder(tmp_path: Path) -> None:
    folder = chatml_folder(tmp_path / "tok")
    ref = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": c}) + "\n" for c in CHATS))
    (tmp_path / "text_rewards.py").write_text(REWARD)
    stop = list(range(0, len(ref), 2))  # half the tokenizer's ids: a random policy stops within a few tokens
    log = tmp_path / "asked.jsonl"
    res = baton("submit", "experiments/grpo_tiny.yaml", f"runs_root={tmp_path / 'runs'}", "rl.task=file",
                f"rl.prompts={tmp_path / 'prompts.jsonl'}", f"rl.tokenizer={folder}", f"rl.stop={stop}",
                "rl.reward=text_rewards:log_text", "model.vocab_size=512", "model.seq_length=72", "rl.prompt_length=64",
                "rl.warmup_steps=0", "trainer.steps=2", "rl.prompts_per_step=2", "--backend", "local", timeout=800,
                env={"PROMPT_LOG": str(log),
                     "PYTHONPATH": os.pathsep.join((str(Path(__file__).resolve().parents[2]), str(tmp_path)))})
    assert res.returncode == 0, res.stdout + res.stderr
    asked = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(asked) == 2 * 2 * 8
    stops = set(stop)
    for a in asked:
        want = list(ref.apply_chat_template(a["messages"], add_generation_prompt=True, return_dict=True)["input_ids"])
        assert a["prompt"] == [ref.convert_tokens_to_ids("<|im_end|>")] * (64 - len(want)) + want
        assert a["prompt_text"] == ref.apply_chat_template(a["messages"], add_generation_prompt=True, tokenize=False)
        body = a["response"][:-1] if a["response"][-1] in stops else a["response"]
        assert 1 <= len(a["response"]) <= 8 and not stops & set(body)  # nothing after the first stop token
        assert a["text"] == ref.decode(body, skip_special_tokens=True)
    assert any(a["response"][-1] in stops for a in asked) and {json.dumps(a["messages"]) for a in asked} == \
        {json.dumps(c) for c in CHATS}
