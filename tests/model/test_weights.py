"""Weight loading: HF directories (sharded or not), tiny GGUF files, tokenizers, clear errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.model import gguf as ggufload
from kvserve.model.config import ModelLoadError
from kvserve.model.weights import load_config, load_model, load_tokenizer, load_weights

from .tinymodel import BYTE_VOCAB, VOCAB_SIZE, write_tiny_model

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", tie=False)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False))


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_load_model_from_hf_dir(tiny: Path) -> None:
    loaded = load_model(str(tiny), dtype=torch.float32, device="cpu")
    assert loaded.name == "m"
    assert loaded.eos_token_ids == [BYTE_VOCAB + 1]
    assert loaded.chat_template and "add_generation_prompt" in loaded.chat_template
    assert loaded.tokenizer.decode(loaded.tokenizer("héllo").input_ids) == "héllo"
    hf = load_file(str(tiny / "model.safetensors"))
    q = hf["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(loaded.model.layers[1].qkv_weight[: q.shape[0]], q)
    assert not loaded.config.tie_word_embeddings
    assert torch.equal(loaded.model.lm_head, hf["lm_head.weight"])


def test_sharded_equals_single_file(tiny: Path, tmp_path: Path) -> None:
    sharded = write_tiny_model(tmp_path / "s", tie=False, shard=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    _same_params(load_weights(sharded), load_weights(tiny))


def test_tied_embeddings_share_storage(tmp_path: Path) -> None:
    model = load_weights(write_tiny_model(tmp_path / "t", tie=True))
    assert model.config.tie_word_embeddings
    assert model.lm_head.data_ptr() == model.embed.data_ptr()


def test_load_tokenizer_without_weights(tiny: Path) -> None:
    bundle = load_tokenizer(str(tiny))
    assert bundle.vocab_size == VOCAB_SIZE and bundle.max_context_len == 512
    assert bundle.eos_token_ids == [BYTE_VOCAB + 1]
    assert bundle.name == "m" and bundle.chat_template


def test_bfloat16_parameters(tiny: Path) -> None:
    model = load_weights(tiny, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# ---- errors ---------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _drop_tensor(path: Path, name: str) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(str(tmp_path / "nope.gguf"))


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))


def test_missing_shard_named(tiny: Path, tmp_path: Path) -> None:
    sharded = write_tiny_model(tmp_path / "s", tie=False, shard=True)
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=victim.name):
        load_weights(sharded)


def test_unsupported_architecture(tiny: Path, tmp_path: Path) -> None:
    bad = _copy(tiny, tmp_path / "bad")
    _edit_config(bad, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="unsupported architecture.*gpt2"):
        load_model(str(bad))


def test_unsupported_rope_type(tiny: Path, tmp_path: Path) -> None:
    bad = _copy(tiny, tmp_path / "bad")
    _edit_config(bad, rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ModelLoadError, match="yarn"):
        load_config(str(bad))


def test_shape_mismatch_names_tensor(tiny: Path, tmp_path: Path) -> None:
    bad = _copy(tiny, tmp_path / "bad")
    _edit_config(bad, intermediate_size=96)
    with pytest.raises(
        ModelLoadError, match=r"mlp\.\w+_proj\.weight has shape \(\d+, \d+\).*expects"
    ):
        load_weights(bad)


def test_missing_tensor_named(tiny: Path, tmp_path: Path) -> None:
    bad = _copy(tiny, tmp_path / "bad")
    _drop_tensor(bad, "model.layers.1.post_attention_layernorm.weight")
    with pytest.raises(
        ModelLoadError, match=r"missing tensor model\.layers\.1\.post_attention_layernorm"
    ):
        load_weights(bad)


def test_untied_config_without_lm_head(tiny: Path, tmp_path: Path) -> None:
    bad = _copy(tiny, tmp_path / "bad")
    _drop_tensor(bad, "lm_head.weight")
    with pytest.raises(ModelLoadError, match="missing tensor lm_head.weight"):
        load_weights(bad)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        load_model(str(junk))


# ---- GGUF -----------------------------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows of llama models."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_TO_GGUF = {v: k for k, v in ggufload._BLOCK_NAMES.items()}


def write_gguf(
    hf_dir: Path, out: Path, *, arch: str, permute: bool, rope_freqs: np.ndarray | None = None
) -> Path:
    """Convert a tiny HF directory to an F32 GGUF the way llama.cpp lays it out."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    for name, t in tensors.items():
        arr = t.numpy()
        if name in ggufload._TOP_NAMES.values():
            gname = next(k for k, v in ggufload._TOP_NAMES.items() if v == name)
        else:
            parts = name.split(".")
            module = ".".join(parts[3:-1])
            gname = f"blk.{parts[2]}.{_TO_GGUF[module]}.{parts[-1]}"
            if permute and module == "self_attn.q_proj":
                arr = _llama_cpp_permute(arr, cfg["num_attention_heads"])
            if permute and module == "self_attn.k_proj":
                arr = _llama_cpp_permute(arr, cfg["num_key_value_heads"])
        w.add_tensor(gname, np.ascontiguousarray(arr))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize(
    ("family", "arch", "permute", "tie"),
    [
        ("llama", "llama", True, True),
        ("llama", "llama", True, False),
        ("qwen2", "qwen2", False, True),
    ],
)
def test_gguf_weights_equal_hf_weights(tmp_path: Path, family, arch, permute, tie) -> None:
    hf_dir = write_tiny_model(tmp_path / "hf", family=family, tie=tie)
    path = write_gguf(hf_dir, tmp_path / "m.F32.gguf", arch=arch, permute=permute)
    from_gguf, from_hf = load_weights(path), load_weights(hf_dir)
    assert from_gguf.config.tie_word_embeddings == tie
    assert from_gguf.config.qkv_bias == (family == "qwen2")
    _same_params(from_gguf, from_hf)


def test_gguf_rope_freqs_tensor_gives_llama3_frequencies(tmp_path: Path) -> None:
    hf_dir = write_tiny_model(tmp_path / "hf", rope_scaling=LLAMA3)
    want = load_weights(hf_dir).rotary.inv_freq
    d = 16
    base = 1.0 / 500000.0 ** (np.arange(0, d, 2) / d)
    factors = base / want.numpy().astype(np.float64)
    path = write_gguf(hf_dir, tmp_path / "m.gguf", arch="llama", permute=True, rope_freqs=factors)
    got = load_weights(path).rotary.inv_freq
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert not math.isclose(float(factors.max()), 1.0)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    hf_dir = write_tiny_model(tmp_path / "hf")
    path = write_gguf(hf_dir, tmp_path / "m.gguf", arch="gpt2", permute=False)
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        load_weights(path)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    assert np.array_equal(ggufload._unpermute(_llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(_llama_cpp_permute(w, 3), w)


def test_gguf_model_name_strips_quant_suffix() -> None:
    from kvserve.model.weights import model_name

    assert model_name(Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert model_name(Path("/x/llama-3.2-1b.gguf")) == "llama-3.2-1b"
