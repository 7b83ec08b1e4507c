"""Chat templates: a checkpoint's tokenizer_config.json template, rendered as
transformers renders it; the plain template for models without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdctl.serve.api.chat_template import PLAIN_TEMPLATE, TemplateError, render_chat
from pdctl.serve.tokenizer import HFTokenizer

# Llama-3 style: the BOS token, header tokens, loop controls, raise_exception, tojson
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    "{# {{ messages | tojson }} #}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief. é"},
    {"role": "user", "content": " Hello "},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Again"},
]


def tokenizer_dir(folder: Path, template: object) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(c): c - 32 for c in range(32, 127)} | {"[UNK]": 100, "<s>": 101}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
        "eos_token": "</s>",
        "unk_token": "[UNK]",
        "chat_template": template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_a_checkpoint_template_renders_as_transformers_renders_it(tmp_path: Path) -> None:
    import transformers

    folder = tokenizer_dir(tmp_path, TEMPLATE)
    ours = HFTokenizer(folder, 128)
    assert ours.chat_template == TEMPLATE and ours.special_tokens["bos_token"] == "<s>"
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    expected = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    rendered = render_chat(MESSAGES, ours.chat_template, ours.special_tokens)
    assert rendered == expected and rendered.startswith("<s><|start_header_id|>system")


def test_named_templates_take_the_default_one(tmp_path: Path) -> None:
    folder = tokenizer_dir(
        tmp_path, [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    )
    assert HFTokenizer(folder, 128).chat_template == "D"


def test_template_errors_are_template_errors() -> None:
    with pytest.raises(TemplateError, match="no tools here"):
        render_chat([{"role": "tool", "content": "x"}], TEMPLATE, {"bos_token": "<s>"})
    with pytest.raises(TemplateError, match="TemplateSyntaxError"):
        render_chat(MESSAGES, "{% for %}", {})


def test_the_plain_template() -> None:
    assert render_chat(MESSAGES[:2], None, {}) == (
        "<|system|>\nBe brief. é\n<|user|>\n Hello \n<|assistant|>\n"
    )
    assert render_chat(MESSAGES[:1], PLAIN_TEMPLATE, {}).endswith("<|assistant|>\n")


def test_the_sandbox_holds() -> None:
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateError):
        render_chat(MESSAGES, escape, {})
