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

from .tinymodel import BYTE_VOCAB, VOCAB_SIZE, causal_attention, write_tiny_model

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


@pytest.mark.parametrize(("family", "extra", "context"), [
    ("mistral", {"sliding_window": 64}, 64), ("mistral", {"sliding_window": None}, 512),
    ("qwen3", {"sliding_window": 64, "use_sliding_window": False}, 512),
    ("qwen3", {"sliding_window": 64, "use_sliding_window": True}, 64), ("phi3", {"sliding_window": 100}, 100)])
def test_a_sliding_window_caps_the_context(tmp_path: Path, family: str, extra: dict, context: int) -> None:
    from kvserve.model.files import kv_shape
    from kvserve.model.tokenizer import load_model_tokenizer

    path = write_tiny_model(tmp_path / "m", family=family, extra=extra)
    assert load_config(str(path)).max_position_embeddings == context  # the runner's
    assert kv_shape(path).max_position == context  # memsvc's pool
    assert load_tokenizer(str(path)).max_context_len == context
    assert load_model_tokenizer(str(path)).max_context_len == context  # the frontend's


def test_an_architecture_not_built_yet_says_what_it_needs(tiny: Path, tmp_path: Path) -> None:
    bad = _copy(tiny, tmp_path / "gemma")
    _edit_config(bad, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"])
    with pytest.raises(ModelLoadError, match=r"'gemma3_text' architectures=.* \(sliding-window layers and Gemma's norms "
                                             r"are not built yet\) \(supported model types: llama, mistral, qwen2, "
                                             r"qwen3, qwen3_moe, mixtral, phi3, olmo2, granite\)"):
        load_weights(bad)


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


_TO_GGUF = {v: k for k, v in ggufload._BLOCK_NAMES.items() if k != "post_attention_norm"}
_TO_GGUF_OLMO2 = _TO_GGUF | {"post_attention_layernorm": "post_attention_norm"}  # its norm is after attention
GRANITE_SCALES = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
                  "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}


def _stacked_experts(tensors: dict) -> dict:
    """The per-expert HF tensors of each layer as llama.cpp stores them: one 3-D tensor a
    projection ([experts, rows, cols], `blk.N.ffn_{gate,up,down}_exps`)."""
    out, experts = {}, {}
    mixtral = {"block_sparse_moe.gate.": "mlp.gate.", "block_sparse_moe.experts.": "mlp.experts.", ".w1.": ".gate_proj.",
               ".w3.": ".up_proj.", ".w2.": ".down_proj."}
    for name, t in tensors.items():
        for a, b in mixtral.items():
            name = name.replace(a, b)
        parts = name.split(".")
        if ".mlp.experts." in name:
            experts.setdefault((parts[2], parts[6]), {})[int(parts[5])] = t
        else:
            out[name] = t
    for (layer, proj), by_e in experts.items():
        out[f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight"] = torch.stack([by_e[e] for e in sorted(by_e)])
    return out


def write_gguf(
    hf_dir: Path, out: Path, *, arch: str, permute: bool, rope_freqs: np.ndarray | None = None,
    metadata: dict | None = None, more: dict | None = None,
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
    if arch == "granite":
        for hf_key, key in GRANITE_SCALES.items():
            w.add_float32(f"{arch}.{key}", cfg[hf_key])
    if "num_local_experts" in cfg:  # Qwen3-MoE as qwen3moe, Mixtral as llama (its experts' size the FFN's)
        w.add_uint32(f"{arch}.expert_count", cfg["num_local_experts"])
        w.add_uint32(f"{arch}.expert_used_count", cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_uint32(f"{arch}.expert_feed_forward_length", cfg["moe_intermediate_size"])
        tensors = _stacked_experts(tensors)
    for key, value in (metadata or {}).items():
        w.add_uint32(f"{arch}.{key}", value)
    for gname, arr in (more or {}).items():
        w.add_tensor(gname, arr)
    names = _TO_GGUF_OLMO2 if arch == "olmo2" else _TO_GGUF
    for name, t in tensors.items():
        arr = t.numpy()
        if name.startswith("blk."):
            gname = name
        elif name in ggufload._TOP_NAMES.values():
            gname = next(k for k, v in ggufload._TOP_NAMES.items() if v == name)
        else:
            parts = name.split(".")
            module = ".".join(parts[3:-1])
            gname = f"blk.{parts[2]}.{names[module]}.{parts[-1]}"
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
        ("qwen3", "qwen3", False, False),  # llama.cpp's Qwen converters do not permute
        ("olmo2", "olmo2", False, False),
        ("granite", "granite", True, True),  # converted as Llama (permuted), with its scales
        ("qwen3_moe", "qwen3moe", False, False),  # experts stacked per projection
        ("mixtral", "llama", True, False),  # llama.cpp writes Mixtral as a llama with experts
    ],
)
def test_gguf_weights_equal_hf_weights(tmp_path: Path, family, arch, permute, tie) -> None:
    extra = {"granite": {"extra": {"embedding_multiplier": 3.0, "residual_multiplier": 0.4, "attention_multiplier": 0.1,
                                   "logits_scaling": 2.5}},
             "qwen3_moe": {"extra": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                                     "norm_topk_prob": True}},
             "mixtral": {"extra": {"num_local_experts": 4, "num_experts_per_tok": 2}}}.get(family, {})
    hf_dir = write_tiny_model(tmp_path / "hf", family=family, tie=tie, **extra)
    path = write_gguf(hf_dir, tmp_path / "m.F32.gguf", arch=arch, permute=permute)
    from_gguf, from_hf = load_weights(path), load_weights(hf_dir)
    assert from_gguf.config.tie_word_embeddings == tie
    assert from_gguf.config.qkv_bias == (family == "qwen2")
    assert from_gguf.config.family == ("llama" if family == "mixtral" else family)
    for field in ("qk_norm", "norm_after", "embedding_multiplier", "residual_multiplier", "attention_multiplier",
                  "logits_scaling", "num_experts", "experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "moe_layers"):
        assert getattr(from_gguf.config, field) == pytest.approx(getattr(from_hf.config, field)), field
    _same_params(from_gguf, from_hf)
    ids = torch.tensor([5, 17, 99, 3, 200])
    same = [m.forward_tokens(ids, torch.arange(5), causal_attention(m.config), torch.tensor([4]))
            for m in (from_gguf, from_hf)]
    torch.testing.assert_close(same[0], same[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("family", "arch", "permute", "biases"), [
    ("qwen3", "qwen3", False, {"attention_bias": True}), ("olmo2", "olmo2", False, {"attention_bias": True}),
    ("granite", "granite", True, {"attention_bias": True, "mlp_bias": True})])
def test_gguf_biases_load(tmp_path: Path, family: str, arch: str, permute: bool, biases: dict) -> None:
    hf_dir = write_tiny_model(tmp_path / "hf", family=family, extra=biases)
    path = write_gguf(hf_dir, tmp_path / "m.gguf", arch=arch, permute=permute)
    from_gguf, from_hf = load_weights(path), load_weights(hf_dir)
    assert (from_gguf.config.o_bias, from_gguf.config.mlp_bias) == (from_hf.config.o_bias, from_hf.config.mlp_bias)
    _same_params(from_gguf, from_hf)


def test_a_gguf_layer_tensor_kvserve_does_not_know_is_refused_by_name(tmp_path: Path) -> None:
    hf_dir = write_tiny_model(tmp_path / "hf", family="qwen3")
    path = write_gguf(hf_dir, tmp_path / "m.gguf", arch="qwen3", permute=False,
                      more={"blk.0.ffn_gate_shexp.weight": np.zeros((8, 48), dtype=np.float32)})
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.ffn_gate_shexp\.weight: a layer tensor kvserve does not know"):
        load_weights(path)


def test_a_gguf_sliding_window_caps_the_context(tmp_path: Path) -> None:
    from kvserve.model.files import kv_shape

    hf_dir = write_tiny_model(tmp_path / "hf", family="olmo2")  # llama.cpp writes OLMo 3 so, with its window
    path = write_gguf(hf_dir, tmp_path / "m.gguf", arch="olmo2", permute=False,
                      metadata={"attention.sliding_window": 64})
    assert load_config(str(path)).max_position_embeddings == 64
    assert kv_shape(path).max_position == 64


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
