"""A Hugging Face folder's tokenizer and chat template (core.data.hf_tokenizer) against
transformers' AutoTokenizer and apply_chat_template on the same folder (ChatML, Llama 3 and
Qwen3's own template): ids, text, rendered conversations (with template variables such as
``enable_thinking``) and the assistant mask must be identical."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from core.config.rl import RESERVED_TEMPLATE_VARIABLES
from core.data.dataset import TokenDataset
from core.data.hf_tokenizer import (
    RESERVED_VARIABLES,
    ChatTemplateError,
    HFTokenizer,
    HFTokenizerError,
    load_hf_tokenizer,
)
from core.data.tokenizer import TokenizerError, load_tokenizer
from tests.hf_tokenizers import CHATML_TEMPLATE, chatml_folder, llama3_folder, qwen3_folder

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["The quick brown fox.", "héllo wörld — 你好 🎉", "  two  spaces\n\nand lines\t", "<|im_end|> inside",
         "", "def add(a, b):\n    return a + b\n", "In 2024: 1234567 tokens; I'LL count 3.14159", "e\u0301 cafe\u0301"]
Messages = list[dict[str, Any]]
CONVERSATIONS: list[Messages] = [
    [{"role": "user", "content": "Hello! What is two plus two?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Quatre."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "héllo wörld 你好 🎉"}, {"role": "assistant", "content": " ça va? naïve café "}],
    [{"role": "system", "content": "  You are terse.\n"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]


BUILDERS = {"chatml": chatml_folder, "llama3": llama3_folder, "qwen3": qwen3_folder}

# Qwen3 conversations and, per assistant turn, the text generation produces after the prompt
# (before <|im_end|>) as Qwen3's template writes the whole conversation: reasoning kept only
# after the last user query, an empty think block on the last turn, tool calls as <tool_call>.
TOOL_CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
QWEN3_SFT: list[tuple[Messages, dict[str, Any], list[str]]] = [
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help you today?"}],
     {}, ["<think>\n\n</think>\n\nHello! How can I help you today?"]),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "<think>\nThey greet.\n</think>\n\nHello!"},
      {"role": "user", "content": "What is two plus two?"},
      {"role": "assistant", "content": "Four.", "reasoning_content": "\n2 + 2 = 4\n"}],
     {}, ["Hello!", "<think>\n2 + 2 = 4\n</think>\n\nFour."]),
    ([{"role": "user", "content": "héllo wörld 你好 🎉"}, {"role": "assistant", "content": "ça va? naïve café"},
      {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
      {"role": "assistant", "content": "<think>x</think>\n\nd 1234567"}],
     {}, ["ça va? naïve café", "b", "<think>\nx\n</think>\n\nd 1234567"]),
    ([{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
      {"role": "tool", "content": "4"}, {"role": "assistant", "content": "It is 4."}],
     {}, ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>', "<think>\n\n</think>\n\nIt is 4."]),
    ([{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Quatre."}],
     {"enable_thinking": False}, ["Quatre."]),  # the empty think block is the generation prompt's
]
QWEN3_CONVERSATIONS = [messages for messages, _, _ in QWEN3_SFT]


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return BUILDERS[request.param](tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[HFTokenizer, Any]:
    path = qwen3_folder(tmp_path_factory.mktemp("qwen3"))
    return load_hf_tokenizer(path), AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@pytest.fixture(scope="module")
def pair(folder: Path) -> tuple[HFTokenizer, Any]:
    return load_hf_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def test_encode_and_decode_equal_transformers(pair: tuple[HFTokenizer, Any]) -> None:
    ours, ref = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.vocab_size == len(ref)
    assert ours.eos_id == ref.eos_token_id


@pytest.mark.parametrize("variables", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_render_and_chat_ids_equal_apply_chat_template(pair: tuple[HFTokenizer, Any], generation_prompt: bool,
                                                       variables: dict[str, Any]) -> None:
    ours, ref = pair
    qwen3 = ours.token_id("<think>") is not None  # the other templates know no tool role
    for messages in CONVERSATIONS + (QWEN3_CONVERSATIONS if qwen3 else []):
        text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **variables)
        assert ours.render(messages, add_generation_prompt=generation_prompt, **variables) == text
        want = ref.apply_chat_template(messages, tokenize=True, return_dict=True,
                                       add_generation_prompt=generation_prompt, **variables)
        assert ours.chat_ids(messages, add_generation_prompt=generation_prompt, **variables) == list(want["input_ids"])


def test_template_variable_names_refused_on_the_login_node_are_the_renderers() -> None:
    assert RESERVED_VARIABLES == RESERVED_TEMPLATE_VARIABLES  # launcher side: core.config.rl, no jinja2


def test_enable_thinking_false_writes_qwen3_empty_think_block(qwen3: tuple[HFTokenizer, Any]) -> None:
    ours, ref = qwen3
    messages = CONVERSATIONS[0]
    off = ours.render(messages, add_generation_prompt=True, enable_thinking=False)
    assert off == ours.render(messages, add_generation_prompt=True) + "<think>\n\n</think>\n\n"
    assert ours.chat_ids(messages, add_generation_prompt=True, enable_thinking=False) == \
        list(ref.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, return_dict=True)[
            "input_ids"])
    with pytest.raises(ChatTemplateError, match=r"chat template variables documents, tools are set by Baton"):
        ours.render(messages, add_generation_prompt=True, tools=[], documents=None)


def test_sft_mask_equals_transformers_assistant_mask(pair: tuple[HFTokenizer, Any]) -> None:
    """ChatML and Llama 3 mark assistant content and its end of turn with ``{% generation %}``:
    transformers' assistant mask is the reference (Qwen3's template has none: see below)."""
    ours, ref = pair
    if "endgeneration" not in str(ours.chat_template):
        pytest.skip("no {% generation %} block in this template")
    for messages in CONVERSATIONS:
        ids, mask = ours.sft_ids(messages)
        want = ref.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == list(want["input_ids"])
        assert mask == [bool(m) for m in want["assistant_masks"]]
        assert any(mask) == any(m["role"] == "assistant" for m in messages)
    with pytest.raises(ChatTemplateError, match="opens with an assistant message; begin it with a system or user"):
        ours.sft_ids([{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Hello"}])


def test_template_from_tokenizer_config_and_special_token_variables(tmp_path: Path) -> None:
    """A template stored in tokenizer_config.json (older save_pretrained) renders the same,
    and ``bos_token`` reaches it as a variable."""
    folder = llama3_folder(tmp_path / "l")
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_hf_tokenizer(f"hf:{folder}")
    ref = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    text = ours.render(CONVERSATIONS[1], add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert text == ref.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True)


def test_template_raise_exception_is_a_user_error(tmp_path: Path) -> None:
    folder = llama3_folder(tmp_path / "l")
    ours, ref = load_hf_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    bad = [{"role": "robot", "content": "beep"}]
    with pytest.raises(Exception, match='unknown role "robot"'):
        ref.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match=r'refused the conversation \(unknown role "robot"\)'):
        ours.render(bad, add_generation_prompt=False)
    chatml = chatml_folder(tmp_path / "c")  # its template adds strings: content parts cannot join
    ours, ref = load_hf_tokenizer(chatml), AutoTokenizer.from_pretrained(str(chatml), local_files_only=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with pytest.raises(TypeError):
        ref.apply_chat_template(parts, tokenize=False)
    with pytest.raises(ChatTemplateError, match=r"refused the conversation \(.*list"):
        ours.render(parts, add_generation_prompt=False)


def test_stop_ids_from_generation_config_int_and_list(tmp_path: Path) -> None:
    one = load_hf_tokenizer(chatml_folder(tmp_path / "one"))
    assert one.stop_ids == (one.token_id("<|im_end|>"),)
    end, eot = 1, 4  # llama3_folder's <|end_of_text|>, <|eot_id|>: the first special tokens in order
    llama = load_hf_tokenizer(llama3_folder(tmp_path / "llama"))
    assert (llama.token_id("<|end_of_text|>"), llama.token_id("<|eot_id|>")) == (end, eot)
    assert llama.stop_ids == (end, eot)
    both = load_hf_tokenizer(chatml_folder(tmp_path / "both", eos_token_id=[2, 0]))
    assert both.stop_ids == (2, 0)
    (tmp_path / "one" / "generation_config.json").unlink()
    assert load_hf_tokenizer(tmp_path / "one").stop_ids == (one.eos_id,)


def _generated_mask(ref: Any, text: str, generated: list[str]) -> tuple[list[int], list[bool]]:
    """The reference: each turn's generated text located in the whole render, mapped to tokens
    through transformers' offsets, plus the <|im_end|> token right after it."""
    enc = ref(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask, at = [False] * len(ids), 0
    for want in generated:
        start = text.index(want + "<|im_end|>", at)
        at = start + len(want)
        tokens = [t for t, (a, b) in enumerate(offsets) if a < at and b > start]
        stop = tokens[-1] + 1
        assert ids[stop] == ref.convert_tokens_to_ids("<|im_end|>") and offsets[stop][0] == at
        for t in [*tokens, stop]:
            mask[t] = True
    return ids, mask


@pytest.mark.parametrize("case", range(len(QWEN3_SFT)))
def test_qwen3_sft_mask_is_what_generation_produces(qwen3: tuple[HFTokenizer, Any], case: int) -> None:
    """Qwen3 writes the last assistant turn otherwise than earlier ones (an empty think block;
    earlier turns lose their reasoning): each turn's loss tokens are what the model generates
    after the generation prompt, as the whole conversation writes them, up to <|im_end|>."""
    ours, ref = qwen3
    messages, variables, generated = QWEN3_SFT[case]
    ids, mask = ours.sft_ids(messages, **variables)
    want = ref.apply_chat_template(messages, tokenize=True, return_dict=True, **variables)
    assert ids == list(want["input_ids"])
    text = ref.apply_chat_template(messages, tokenize=False, **variables)
    assert (ids, mask) == _generated_mask(ref, text, generated)
    assert ref.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False) == \
        "".join(g + "<|im_end|>" for g in generated)


def test_sft_refuses_turns_generation_cannot_produce(qwen3: tuple[HFTokenizer, Any], tmp_path: Path) -> None:
    """With enable_thinking false the generation prompt ends in an empty think block that an
    earlier Qwen3 turn does not have; a stop token inside a message; a folder whose stop tokens
    never end a turn: refused, naming the folder."""
    ours, _ = qwen3
    multi = QWEN3_SFT[1][0]
    assert ours.sft_ids(multi)[0] == ours.chat_ids(multi, add_generation_prompt=False)
    with pytest.raises(ChatTemplateError, match=rf"^{ours.name}: the chat template renders messages\[:2\] with the "
                                                "generation prompt otherwise than the start of the whole conversation"):
        ours.sft_ids(multi, enable_thinking=False)
    with pytest.raises(ChatTemplateError, match=r"assistant messages\[1\] holds the stop token '<\|endoftext\|>'"):
        ours.sft_ids([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a<|endoftext|>b"}])
    folder = chatml_folder(tmp_path / "c", eos_token_id=0)  # <|endoftext|>: the turns end with <|im_end|>
    with pytest.raises(ChatTemplateError, match=rf"^{folder}: assistant messages\[2\] ends with none of the stop "
                                                r"tokens \('<\|endoftext\|>'\) before the next turn"):
        load_hf_tokenizer(folder).sft_ids(CONVERSATIONS[1])


def test_bad_folders_are_refused_naming_the_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(HFTokenizerError, match=rf"^{empty / 'tokenizer.json'}: no such file"):
        load_hf_tokenizer(empty)
    with pytest.raises(TokenizerError, match="no such file or folder"):
        load_tokenizer(f"hf:{tmp_path / 'missing'}")
    folder = chatml_folder(tmp_path / "c")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 10**6]}))
    with pytest.raises(HFTokenizerError, match=r"generation_config.json: eos_token_id \[2, 1000000\] is not an id"):
        load_hf_tokenizer(folder)
    (folder / "generation_config.json").unlink()
    (folder / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="the chat template is not valid jinja"):
        load_hf_tokenizer(folder)
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        load_hf_tokenizer(folder).render(CONVERSATIONS[0], add_generation_prompt=True)


def test_load_tokenizer_takes_hf_prefix_folder_and_file(tmp_path: Path) -> None:
    folder = chatml_folder(tmp_path / "c")
    for spec in (f"hf:{folder}", str(folder), folder / "tokenizer.json"):
        tok = load_tokenizer(spec)
        assert isinstance(tok, HFTokenizer) and tok.chat_template == CHATML_TEMPLATE
        assert tok.encode("Hello!") == load_hf_tokenizer(folder).encode("Hello!")


def test_baton_data_build_with_a_hugging_face_folder(tmp_path: Path) -> None:
    """``baton data build --tokenizer hf:PATH``: every document is AutoTokenizer's ids, then
    tokenizer_config.json's eos_token."""
    folder = llama3_folder(tmp_path / "l")
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    res = subprocess.run([sys.executable, "-m", "launcher.cli", "data", "build", str(src), "-o", str(tmp_path / "d.h5"),
                          "--tokenizer", f"hf:{folder}"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr
    ref = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    ds = TokenDataset(tmp_path / "d.h5")
    assert (ds.vocab_size, ds.eos_id, ds.tokenizer) == (len(ref), ref.convert_tokens_to_ids("<|eot_id|>"), str(folder))
    assert [list(ds.document(i)) for i in range(len(TEXTS))] == \
        [ref.encode(t, add_special_tokens=False) + [ref.eos_token_id] for t in TEXTS]
