"""A Hugging Face folder's tokenizer in RL: ``rl.tokenizer: hf`` (the default with
``init_from: hf:PATH``) and its login-node checks, chat-message prompts, stop tokens
(generation_config.json's, or ``rl.stop``), generation stopping at any of them, and the
reward's text ending before the stop token. References: transformers' AutoTokenizer and
apply_chat_template on the same folder; a model whose next token is known."""
from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from transformers import AutoTokenizer

from core.config import run as config
from core.config import tokvocab
from core.controller.generation import GeneratorFlow, Responses
from core.data.prompts import PromptFileError, read_prompts
from core.data.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer, stop_ids, text_before_stop
from core.errors import ConfigError
from core.flows import calls as gen_calls
from tests.helpers import floats, ints, save_hf_model
from tests.hf_tokenizers import chatml_folder, llama3_folder, qwen3_folder

REPO = Path(__file__).resolve().parents[2]
CHATS = [
    [{"role": "user", "content": "What is two plus two?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "héllo wörld 你好 🎉"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face model folder (a random Qwen3 of vocabulary 512) with a ChatML tokenizer."""
    folder = save_hf_model("qwen3", tmp_path_factory.mktemp("chatml"), vocab_size=512)
    return chatml_folder(folder, eos_token_id=[2, 0])  # <|im_end|>, <|endoftext|>


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tokenizer over a model whose vocabulary (300) is smaller than its ids."""
    return chatml_folder(save_hf_model("qwen3", tmp_path_factory.mktemp("small"), vocab_size=300))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama3_folder(tmp_path_factory.mktemp("llama3"))


@functools.cache
def _grpo_without_shape() -> Path:
    """grpo_tiny.yaml without its model's shape: with ``init_from: hf:`` config.json gives it."""
    exp = yaml.safe_load((REPO / "experiments" / "grpo_tiny.yaml").read_text())
    exp["model"] = {"kind": "gpt", "seq_length": exp["model"]["seq_length"]}
    path = Path(tempfile.mkdtemp(prefix="baton-hf-rl-")) / "grpo_hf.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def _exp(*overrides: str) -> tuple[Path, list[str]]:
    """grpo_tiny.yaml and ``overrides``; with an ``hf:`` init, the model's shape is the folder's."""
    if any(o.startswith("init_from=hf:") for o in overrides):
        return _grpo_without_shape(), list(overrides)
    return REPO / "experiments" / "grpo_tiny.yaml", ["model.vocab_size=512", *overrides]


def _grpo(*overrides: str) -> config.RunConfig:
    path, more = _exp(*overrides)
    return config.load(path, ["rl.task=file", f"rl.prompts={REPO / 'experiments' / 'grpo_tiny.yaml'}", *more])


# --- config: the login node ----------------------------------------------------------------
def test_hf_is_the_tokenizer_by_default_with_an_hf_init_and_byte_otherwise(chatml: Path) -> None:
    assert tokvocab.source(None, f"hf:{chatml}") == f"hf:{chatml}"
    assert tokvocab.source("hf", f"hf:{chatml}") == f"hf:{chatml}"
    assert tokvocab.source(None, None) == tokvocab.source(None, "runs/x:10") == "byte"
    assert tokvocab.source(str(chatml), None) == f"hf:{chatml}"
    cfg = _grpo(f"init_from=hf:{chatml}")
    assert cfg.rl.tokenizer is None and tokvocab.read_vocab(tokvocab.source(None, cfg.init_from)).size == \
        len(AutoTokenizer.from_pretrained(str(chatml), local_files_only=True))


@pytest.mark.parametrize(("overrides", "message"), [
    (["init_from=hf:{small}"],
     r"^rl.tokenizer: {small} has {n} tokens > model.vocab_size = 300; raise model.vocab_size to at least {n}$"),
    (["rl.tokenizer=hf"], r"^rl.tokenizer: hf reads the tokenizer of init_from: hf:PATH, but init_from is None; "),
    (["rl.tokenizer={chatml}", "rl.stop=[<|im_end|>, <|eot_id|>, '!!']"],
     r"^rl.stop: '<\|eot_id\|>', '!!' not a token of {chatml}; give tokens of its vocabulary"),
    (["rl.tokenizer={chatml}", "rl.stop=[2, {n}]"], r"^rl.stop: {n} not an id of {chatml} \(0..{last}\)"),
    (["rl.stop=[<|im_end|>]"], r"^rl.stop: token strings \('<\|im_end\|>'\) need a Hugging Face tokenizer; byte "),
    (["rl.stop=[]"], r"^rl.stop: an empty list stops nothing"),
    (["rl.task=counting", "rl.prompts=null", "rl.stop=[3]"], r"^rl.stop: \(3,\) is read only with rl.task: file"),
    (["rl.task=counting", "rl.prompts=null", "rl.chat_template_kwargs={enable_thinking: false}"],
     r"^rl.chat_template_kwargs: \{'enable_thinking': False\} is read only with rl.task: file"),
    (["rl.chat_template_kwargs={enable_thinking: [1]}"],
     r"^rl.chat_template_kwargs.enable_thinking: \[1\] is not true or false or an integer or a string or a number "),
    (["rl.chat_template_kwargs=[enable_thinking]"], r"^rl.chat_template_kwargs: \['enable_thinking'\] is not a mapping"),
    (["rl.chat_template_kwargs={documents: x, enable_thinking: false}"],
     r"^rl.chat_template_kwargs: documents is set by the chat template call itself, not a template variable; drop "),
])
def test_bad_tokenizer_settings_are_refused_in_one_line(chatml: Path, small: Path, overrides: list[str],
                                                        message: str) -> None:
    n = len(AutoTokenizer.from_pretrained(str(chatml), local_files_only=True))
    fill = {"{chatml}": str(chatml), "{small}": str(small), "{n}": str(n), "{last}": str(n - 1)}

    def filled(text: str) -> str:
        for k, v in fill.items():
            text = text.replace(k, v)
        return text

    with pytest.raises(ConfigError, match=filled(message)) as err:
        _grpo(*map(filled, overrides))
    assert "\n" not in str(err.value)


def test_the_vocabulary_read_on_the_login_node_is_the_tokenizers(chatml: Path, llama: Path) -> None:
    for folder in (chatml, llama):
        ref = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        vocab = tokvocab.read_vocab(f"hf:{folder}")
        assert vocab.size == len(ref) and vocab.ids == ref.get_vocab()


# --- stop tokens and the reward's text -------------------------------------------------------
def test_stop_ids_default_to_generation_config_and_rl_stop_overrides(chatml: Path, llama: Path) -> None:
    tok = load_tokenizer(f"hf:{chatml}")
    ref = AutoTokenizer.from_pretrained(str(chatml), local_files_only=True)
    assert stop_ids(tok, None) == (ref.convert_tokens_to_ids("<|im_end|>"), ref.convert_tokens_to_ids("<|endoftext|>"))
    assert stop_ids(load_tokenizer(llama), None) == tuple(json.loads((llama / "generation_config.json").read_text())
                                                          ["eos_token_id"])
    assert stop_ids(tok, ("<|endoftext|>", 7, "<|endoftext|>")) == (ref.convert_tokens_to_ids("<|endoftext|>"), 7)
    assert stop_ids(ByteTokenizer(), None) == (256,)
    with pytest.raises(TokenizerError, match=r"^rl.stop: '<\|eot_id\|>', 9999: not a token of "):
        stop_ids(tok, ("<|im_end|>", "<|eot_id|>", 9999))


def test_text_after_the_stop_token_never_reaches_the_reward(chatml: Path) -> None:
    tok = load_tokenizer(chatml)
    ref = AutoTokenizer.from_pretrained(str(chatml), local_files_only=True)
    stop = stop_ids(tok, None)
    answer = ref.encode("Two plus two is four.", add_special_tokens=False)
    later = ref.encode(" café 🎉", add_special_tokens=False)
    for end in stop:
        generated = tuple(answer + [end] + later), tuple(float(-i) for i in range(len(answer) + 1 + len(later)))
        cut = Responses(ints([generated[0]]), floats([generated[1]])).until(stop)
        tokens, logps = cut.tokens.tolist()[0], cut.logprobs.tolist()[0]
        assert tokens == tuple(answer + [end]) and logps == generated[1][: len(answer) + 1]  # the stop token trains
        assert text_before_stop(tok, stop, tokens) == ref.decode(answer) == "Two plus two is four."
        assert text_before_stop(tok, stop, generated[0]) == "Two plus two is four."
    whole = Responses(ints([answer]), floats([[0.0] * len(answer)])).until(stop)
    assert whole.tokens.tolist() == [tuple(answer)]  # no stop: all of it
    assert text_before_stop(tok, stop, answer + later) == ref.decode(answer + later)


def test_generation_stops_at_any_stop_token() -> None:
    """A model whose next token is the last one + 1: each sequence ends at the first stop id it
    reaches, later positions hold the first stop id with log-prob 0."""
    import torch

    from core.model.gpt.generate import Sampling, generate

    class Counting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))
            self.calls = 0

        def forward(self, tokens: torch.Tensor, positions: Any, mask: Any, **_: Any) -> torch.Tensor:
            self.calls += 1
            return torch.nn.functional.one_hot((tokens + 1) % 16, 16).float() * 5

    tokens, logps = generate(Counting(), [[1], [6], [12]], Sampling(max_new_tokens=6, eos=(9, 5)), seeds=[0, 1, 2],
                             max_length=16)
    assert tokens == [[2, 3, 4, 5, 9, 9], [7, 8, 9, 9, 9, 9], [13, 14, 15, 0, 1, 2]]
    assert [sum(1 for x in row if x != 0.0) for row in logps] == [4, 3, 6]
    # every row ended by the 4th new token: 4 forwards (the prefill and 3 decode steps), not 6;
    # the rows are a full-length loop's, padded after their stop
    model = Counting()
    tokens, logps = generate(model, [[1], [6]], Sampling(max_new_tokens=10, eos=(9, 5)), seeds=[0, 1], max_length=16)
    assert model.calls == 4 and tokens == [[2, 3, 4, 5] + [9] * 6, [7, 8, 9] + [9] * 7]
    assert [len(row) for row in logps] == [10, 10] and logps[0][4:] == [0.0] * 6


# --- prompts given as chat messages ---------------------------------------------------------
def test_chat_message_prompts_are_the_chat_templates_ids_left_padded(tmp_path: Path, chatml: Path, llama: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": chat, "answer": str(i)}) + "\n" for i, chat in enumerate(CHATS)))
    for folder in (chatml, llama):
        tok = load_tokenizer(f"hf:{folder}")
        ref = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        got = read_prompts(f, key="prompt", tokenizer=tok, length=64)
        for chat, prompt in zip(CHATS, got, strict=True):
            want = list(ref.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"])
            assert prompt.tokens == (tok.eos_id,) * (64 - len(want)) + tuple(want)
            assert prompt.meta["prompt_text"] == ref.apply_chat_template(chat, add_generation_prompt=True,
                                                                         tokenize=False)
            assert prompt.meta["messages"] == chat
    with pytest.raises(PromptFileError, match=r"p.jsonl:1: chat messages need a tokenizer with a chat template; "
                                              r"byte has none"):
        read_prompts(f, key="prompt", tokenizer=ByteTokenizer(), length=64)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"content": "no role"}]}) + "\n")
    with pytest.raises(PromptFileError, match=r"bad.jsonl:1: field 'prompt' is list, neither text nor chat messages"):
        read_prompts(bad, key="prompt", tokenizer=load_tokenizer(chatml), length=64)


def test_chat_template_kwargs_reach_every_prompt_render(tmp_path: Path) -> None:
    """``rl.chat_template_kwargs: {enable_thinking: false}`` from the config to the prompts'
    ids: Qwen3's generation prompt with its empty think block, as apply_chat_template gives it."""
    folder = qwen3_folder(tmp_path / "qwen3")
    cfg = _grpo(f"rl.tokenizer={folder}", "rl.chat_template_kwargs={enable_thinking: false}")
    assert cfg.rl.chat_template_kwargs == {"enable_thinking": False}
    assert config.from_data(config.to_dict(cfg)).rl.chat_template_kwargs == {"enable_thinking": False}
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": chat}) + "\n" for chat in CHATS))
    ref = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    got = read_prompts(f, key="prompt", tokenizer=load_tokenizer(f"hf:{folder}"), length=64,
                       template_variables=cfg.rl.chat_template_kwargs)
    for chat, prompt in zip(CHATS, got, strict=True):
        text = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, enable_thinking=False)
        assert prompt.meta["prompt_text"] == text and text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        want = ref.apply_chat_template(chat, add_generation_prompt=True, return_dict=True, enable_thinking=False)
        assert prompt.tokens[64 - len(want["input_ids"]):] == tuple(want["input_ids"])


# --- samples.jsonl with init_from hf: -------------------------------------------------------
class _Generator:
    """The generator group's workers (a process boundary): records GENERATE, answers scripted tokens."""

    ranks = (0,)
    dims = SimpleNamespace(dp=1)

    def __init__(self, tokens: list[list[int]]) -> None:
        self.tokens, self.requests = tokens, []  # type: ignore[var-annotated]

    def call_each(self, method: Any, shares: list[Any], timeout_s: float | None = None) -> list[Any]:
        self.requests += shares
        return [gen_calls.Generated(replica=0, version=3, tokens=ints(self.tokens),
                                    logprobs=floats((0.0,) * len(t) for t in self.tokens))]

    def start_each(self, method: Any, shares: list[Any], timeout_s: float | None = None) -> SimpleNamespace:
        """The call's handle (RoleGroup.start_each), answered already."""
        answers = self.call_each(method, shares, timeout_s)
        return SimpleNamespace(wait=lambda: answers, done=lambda: True)


@pytest.mark.parametrize("eos", [None, 7])
def test_samples_stop_at_the_folders_stop_tokens_and_carry_their_text(tmp_path: Path, chatml: Path, eos: int | None
                                                                      ) -> None:
    ref = AutoTokenizer.from_pretrained(str(chatml), local_files_only=True)
    answer = ref.encode("Two plus two is four.", add_special_tokens=False)
    end = ref.convert_tokens_to_ids("<|im_end|>")
    scripted = [answer + [end] + answer[:2], answer[:3]]
    path, more = _exp(f"init_from=hf:{chatml}", *([f"generator.eos={eos}"] if eos else []))
    cfg = config.load(path, more)
    generator = _Generator(scripted)
    flow = GeneratorFlow(cfg, SimpleNamespace(samples=tmp_path / "samples.jsonl"), None, generator, generator)
    flow._prompts = ((1, 2, 3, 4), (5, 6, 7, 8))
    flow.generate(step=3)
    assert [r.eos for r in generator.requests] == [(eos,) if eos else (end, ref.convert_tokens_to_ids("<|endoftext|>"))]
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    want = [ref.decode(answer), ref.decode(answer[:3])] if not eos else \
        [ref.decode(t[: t.index(eos)] if eos in t else t, skip_special_tokens=True) for t in scripted]
    assert [r["text"] for r in rows] == want and [r["tokens"] for r in rows] == scripted


def test_a_model_folder_without_a_tokenizer_generates_ids_without_text(tmp_path: Path) -> None:
    """An export of a run trained on token ids has no tokenizer.json: its samples are ids only,
    stopping only at generator.eos (none here)."""
    folder = save_hf_model("qwen3", tmp_path / "model", vocab_size=512)
    assert not (folder / "tokenizer.json").exists()
    path, more = _exp(f"init_from=hf:{folder}")
    generator = _Generator([[5, 6, 7], [8, 9]])
    flow = GeneratorFlow(config.load(path, more), SimpleNamespace(samples=tmp_path / "samples.jsonl"), None,
                         generator, generator)
    flow._prompts = ((1, 2, 3, 4), (5, 6, 7, 8))
    flow.generate(step=0)
    assert [r.eos for r in generator.requests] == [()]
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [[5, 6, 7], [8, 9]] and all("text" not in r for r in rows)
