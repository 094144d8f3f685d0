"""A Hugging Face folder's tokenizer and chat template (core.data.hf_tokenizer) against
transformers' AutoTokenizer and apply_chat_template on the same folder: ids, text, rendered
conversations and the assistant mask must be identical."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from core.data.dataset import TokenDataset
from core.data.hf_tokenizer import ChatTemplateError, HFTokenizer, HFTokenizerError, load_hf_tokenizer
from core.data.tokenizer import TokenizerError, load_tokenizer
from tests.hf_tokenizers import CHATML_TEMPLATE, chatml_folder, llama3_folder

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["The quick brown fox.", "héllo wörld — 你好 🎉", "  two  spaces\n\nand lines\t", "<|im_end|> inside",
         "", "def add(a, b):\n    return a + b\n", "In 2024: 1234567 tokens; I'LL count 3.14159", "e\u0301 cafe\u0301"]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello! What is two plus two?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Quatre."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "héllo wörld 你好 🎉"}, {"role": "assistant", "content": " ça va? naïve café "}],
    [{"role": "system", "content": "  You are terse.\n"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = chatml_folder if request.param == "chatml" else llama3_folder
    return build(tmp_path_factory.mktemp(request.param))


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


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_render_and_chat_ids_equal_apply_chat_template(pair: tuple[HFTokenizer, Any], generation_prompt: bool) -> None:
    ours, ref = pair
    for messages in CONVERSATIONS:
        text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert ours.render(messages, add_generation_prompt=generation_prompt) == text
        want = ref.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt)
        assert ours.chat_ids(messages, add_generation_prompt=generation_prompt) == list(want["input_ids"])


def test_sft_mask_equals_transformers_assistant_mask(pair: tuple[HFTokenizer, Any]) -> None:
    ours, ref = pair
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


def test_inconsistent_template_is_refused_for_sft(tmp_path: Path) -> None:
    """A template that writes the last assistant turn otherwise than earlier ones (as Qwen3's
    empty <think> block) cannot mark assistant tokens by prefixes: refused, naming the folder."""
    qwen3ish = CHATML_TEMPLATE.replace("{% generation %}", "{% generation %}{% if loop.last %}{{- '<think></think>' }}"
                                       "{% endif %}")
    folder = chatml_folder(tmp_path / "q3", template=qwen3ish)
    tok = load_hf_tokenizer(folder)
    assert tok.sft_ids(CONVERSATIONS[1])[0] == tok.chat_ids(CONVERSATIONS[1], add_generation_prompt=False)
    with pytest.raises(ChatTemplateError, match=rf"^{folder}: the chat template renders messages\[:2\] as other tokens"):
        tok.sft_ids(CONVERSATIONS[2])


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
