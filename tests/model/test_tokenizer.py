"""The torch-free frontend tokenizer against transformers: same ids, same text, same chats.

On the embedded default model (SmolLM2 GGUF, through the tokenizer.json cache) and on the
tiny HF directory the tests write; plus the GGUF cache being built in a child process, the
byte tokenizer, and chat-template errors.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.model import tokenizer_cache
from kvserve.model.chat_template import ChatTemplate, ChatTemplateError
from kvserve.model.files import ModelFileError, resolve_model
from kvserve.model.tokenizer import ByteTokenizer, ModelTokenizer, load_model_tokenizer
from kvserve.model.weights import TokenizerBundle, load_tokenizer

from .tinymodel import BYTE_VOCAB, write_tiny_model

TEXTS = ["Hello world", " leading space", "héllo € 你好 😀", "<|im_start|>user\nhi<|im_end|>",
         "a  b\n\n\tc  ", "\ufffd x", "don't . , ?", "<|bos|>x<|eos|>", "1234567 + 89 = ?", ""]
CHATS = [
    [("user", "hi")],
    [("system", "Be brief."), ("user", "héllo €"), ("assistant", "Yes."), ("user", "and?")],
    [("user", "{{ not a template }} {% raw %}")],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module", params=["default", "tiny"])
def pair(request: pytest.FixtureRequest, tiny: Path) -> tuple[ModelTokenizer, TokenizerBundle]:
    spec = None if request.param == "default" else str(tiny)
    return load_model_tokenizer(spec), load_tokenizer(spec)


def test_metadata_matches(pair: tuple[ModelTokenizer, TokenizerBundle]) -> None:
    ours, ref = pair
    assert (ours.name, ours.vocab_size, ours.max_context_len) == (ref.name, ref.vocab_size, ref.max_context_len)
    assert ours.eos_token_ids == ref.eos_token_ids
    assert ours.chat_template == ref.chat_template


def test_encode_matches_transformers(pair: tuple[ModelTokenizer, TokenizerBundle]) -> None:
    ours, ref = pair
    for text in TEXTS:
        assert ours.encode(text) == ref.tokenizer.encode(text, add_special_tokens=False), text


def test_decode_matches_transformers(pair: tuple[ModelTokenizer, TokenizerBundle]) -> None:
    ours, ref = pair
    rng = random.Random(0)
    n = len(ref.tokenizer)
    for _ in range(500):
        ids = [rng.randrange(n) for _ in range(rng.randint(0, 16))]
        assert ours.decode(ids) == ref.tokenizer.decode(ids, skip_special_tokens=True), ids
    for text in TEXTS:
        ids = ref.tokenizer.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_matches_transformers(pair: tuple[ModelTokenizer, TokenizerBundle],
                                   add_generation_prompt: bool) -> None:
    ours, ref = pair
    for chat in CHATS:
        want = ref.tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in chat], chat_template=ref.chat_template,
            add_generation_prompt=add_generation_prompt, tokenize=False)
        assert ours.chat is not None and ours.chat.render(chat, add_generation_prompt) == want
        assert ours.render_chat(chat, add_generation_prompt) == ref.tokenizer.encode(want, add_special_tokens=False)


def test_template_features_render_as_transformers(tiny: Path, tmp_path: Path) -> None:
    """raise_exception, tojson (no HTML escaping), special-token variables, trim/lstrip
    blocks, loop controls and {% generation %}, each rendered by both."""
    from transformers import AutoTokenizer

    template = (
        "{{ bos_token }}{% for m in messages %}\n"
        "  {% if m['role'] == 'tool' %}{{ raise_exception('no tools: ' + m['content']) }}{% endif %}\n"
        "  {% if loop.index > 3 %}{% break %}{% endif %}\n"
        "  {{ m | tojson }}{% generation %}<{{ m['role'] | upper }}>{% endgeneration %}\n"
        "{% endfor %}{% if add_generation_prompt %}{{ eos_token }}{% endif %}"
    )
    ours = ChatTemplate(template, {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"})
    ref = AutoTokenizer.from_pretrained(str(tiny))
    for chat in ([("user", "<b>&é</b>"), ("assistant", 'say "x"')], [("user", "a")] * 5):
        msgs = [{"role": r, "content": c} for r, c in chat]
        for gen in (True, False):
            want = ref.apply_chat_template(msgs, chat_template=template, add_generation_prompt=gen, tokenize=False)
            assert ours.render(chat, gen) == want
    with pytest.raises(ChatTemplateError, match="no tools: x"):
        ours.render([("tool", "x")], True)
    with pytest.raises(ChatTemplateError, match="chat_template: does not compile"):
        ChatTemplate("{% for %}", {})


def test_template_is_sandboxed() -> None:
    tpl = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(ChatTemplateError):
        tpl.render([("user", "x")], True)


def test_hf_directory_sources(tiny: Path, tmp_path: Path) -> None:
    """EOS ids from generation_config.json, config.json and the tokenizer; the template
    from tokenizer_config.json when there is no chat_template.jinja."""
    d = tmp_path / "m"
    d.mkdir()
    for name in ("tokenizer.json", "config.json"):
        (d / name).write_bytes((tiny / name).read_bytes())
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "{{ messages[0]['content'] }}"}]
    config["eos_token"] = {"content": "<|pad|>", "special": True}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, BYTE_VOCAB + 1]}))
    tok = load_model_tokenizer(str(d))
    assert tok.eos_token_ids == [5, BYTE_VOCAB + 1, BYTE_VOCAB + 2]
    assert tok.render_chat([("user", "hey")], True) == tok.encode("hey")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelFileError, match="no tokenizer.json"):
        load_model_tokenizer(str(d))


def test_model_without_template_refuses_chats(tiny: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    for name in ("tokenizer.json", "config.json"):
        (d / name).write_bytes((tiny / name).read_bytes())
    tok = load_model_tokenizer(str(d))
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.render_chat([("user", "x")], True)


def test_gguf_tokenizer_cache_is_built_in_a_child_process(tmp_path: Path) -> None:
    """A missing cache entry is built by `python -m kvserve.model.tokenizer_cache` (so the
    caller never imports transformers) into the same directory model-side code reads."""
    gguf = resolve_model(None)
    root = tmp_path / "tokenizers"
    code = ("import sys; from pathlib import Path; from kvserve.model import tokenizer_cache as c\n"
            f"print(c.ensure_cached(Path({str(gguf)!r}), Path({str(root)!r})))\n"
            "print('transformers' in sys.modules, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    target, imported = out.stdout.strip().splitlines()
    assert imported == "False False"
    assert Path(target) == tokenizer_cache.cache_target(gguf, root)
    assert (Path(target) / "tokenizer.json").is_file()
    assert [p.name for p in root.iterdir()] == [Path(target).name]  # no temporary left behind
    assert tokenizer_cache.ensure_cached(gguf, root) == Path(target)


def test_gguf_cache_build_failure_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelFileError, match="junk.gguf"):
        tokenizer_cache.ensure_cached(bad, tmp_path / "tokenizers")


def test_byte_tokenizer() -> None:
    tok = ByteTokenizer()
    assert tok.encode("hé<|eos|>") == list("hé<|eos|>".encode())
    assert tok.decode([*b"ok", 256, 300]) == "ok"
    assert tok.decode(list(b"ok\xc3")) == "ok\ufffd"
    assert tok.render_chat([("user", "hi"), ("assistant", "yo")], True) == list(b"<user>hi\n<assistant>yo\n<assistant>")
    assert tok.render_chat([("user", "hi")], False) == list(b"<user>hi\n")
    assert (tok.vocab_size, tok.eos_token_ids, tok.stable_replacement) == (257, [256], True)
