"""Loading a model: a Hugging Face directory or a `.gguf` file -> `LoadedModel`.

`load_model` builds `LlamaForCausalLM` with the requested dtype/device and fills every
parameter, checking names and shapes against the config; `load_tokenizer` gives the
tokenizer, EOS ids and chat template without touching weights (the frontend uses it).
Errors are `ModelLoadError`s that name the file, tensor or field at fault. This module
knows nothing about KV slots, scheduling or sampling.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.model import gguf as ggufload
from kvserve.model.config import ModelConfig, ModelLoadError, config_from_hf
from kvserve.model.files import ModelFileError, gguf_eos_ids, model_name, resolve_model
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.quant import auto_mode
from kvserve.paths import cache_dir

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "TokenizerBundle",
    "load_config",
    "load_model",
    "load_tokenizer",
    "load_weights",
]

@dataclass(slots=True)
class LoadedModel:
    """A model ready to run, with what serving it needs from the checkpoint."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any  # transformers PreTrainedTokenizerFast
    eos_token_ids: list[int]
    chat_template: str | None
    name: str
    quantization: str = "none"  # the mode the projections run in ("auto" resolved)


@dataclass(frozen=True, slots=True)
class TokenizerBundle:
    """The tokenizer side of a model, loaded without its weights."""

    tokenizer: Any
    eos_token_ids: list[int]
    chat_template: str | None
    name: str
    vocab_size: int
    max_context_len: int


def _resolve(spec: str | None) -> Path:
    try:
        return resolve_model(spec)
    except ModelFileError as exc:
        raise ModelLoadError(str(exc)) from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"model file {path}: no such file") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"model file {path}: {exc}") from None


def load_config(spec: str | None) -> ModelConfig:
    """Only the ModelConfig of a model (reads config.json or GGUF metadata)."""
    path = _resolve(spec)
    if path.is_dir():
        return config_from_hf(_read_json(path / "config.json"), str(path / "config.json"))
    return ggufload.gguf_config(ggufload.open_reader(path), path)


def _gguf_reader(path: Path) -> Any:
    """The GGUF reader of `path` for one load, or None for a HF directory. Opening one parses
    the whole header (every vocabulary string: about 4 s for the default model on a 2-core
    CPU), so a load opens it once and hands it to each part that reads the file."""
    return None if path.is_dir() else ggufload.open_reader(path)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"model file {index}: no weight_map")
        files = [path / f for f in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model directory {path}: no *.safetensors weights")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"model file {f}: no such file (listed in {index.name})")
    return files


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor, str]]:
    from safetensors import safe_open

    for f in _safetensors_files(path):
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name), str(f)
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise ModelLoadError(f"model file {f}: cannot read safetensors ({exc})") from None


def _fill(
    model: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor, str]], where: str
) -> None:
    slots = model.weight_slots()
    seen: set[str] = set()
    for name, tensor, source in tensors:
        slot = slots.get(name)
        if slot is None:
            continue  # e.g. rotary inv_freq buffers, a tied lm_head copy
        if tuple(tensor.shape) != slot.shape:
            raise ModelLoadError(
                f"model file {source}: tensor {name} has shape {tuple(tensor.shape)}, "
                f"the config expects {slot.shape}"
            )
        slot.param.data[slot.start : slot.start + slot.shape[0]].copy_(tensor)
        seen.add(name)
    missing = [n for n in slots if n not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"model {where}: missing tensor {missing[0]}{more}")


def load_weights(
    path: Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    reader: Any = None,
) -> LlamaForCausalLM:
    """Build the model at `path` (a HF directory or a .gguf file) and fill every parameter;
    `reader`: the .gguf file's reader where the caller has it open."""
    device = torch.device(device)
    if path.is_dir():
        config = config_from_hf(_read_json(path / "config.json"), str(path / "config.json"))
        model = LlamaForCausalLM(config, dtype=dtype, device=device)
        _fill(model, _iter_safetensors(path), str(path))
    else:
        reader = reader if reader is not None else ggufload.open_reader(path)
        config = ggufload.gguf_config(reader, path)
        model = LlamaForCausalLM(config, dtype=dtype, device=device)
        tensors = ((n, t, str(path)) for n, t in ggufload.iter_tensors(reader, config, path))
        _fill(model, tensors, str(path))
    return model.eval()


def load_model(
    spec: str | None, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    quantization: str = "none",
) -> LoadedModel:
    """Load weights and tokenizer of `spec` (None: the embedded default model); `quantization`:
    weight-only quantization of the projections on CPU (`kvserve.model.quant`), "auto" the
    mode the file and device call for (`resolve_quantization`; the result's `quantization`
    says which). A .gguf file's header is parsed once for all of it."""
    path = _resolve(spec)
    reader = _gguf_reader(path)
    if quantization == "auto":
        quantization = _auto_quantization(reader, str(device))
    model = load_weights(path, dtype=dtype, device=device, reader=reader)
    model.quantize(quantization)
    bundle = _tokenizer_bundle(path, model.config, reader)
    return LoadedModel(
        model=model,
        config=model.config,
        tokenizer=bundle.tokenizer,
        eos_token_ids=bundle.eos_token_ids,
        chat_template=bundle.chat_template,
        name=bundle.name,
        quantization=quantization,
    )


def _auto_quantization(reader: Any, device: str) -> str:
    return auto_mode({} if reader is None else ggufload.projection_types(reader), device)


def resolve_quantization(mode: str, spec: str | None, device: str) -> str:
    """`mode` itself, or for "auto" the mode the model file and device call for
    (`kvserve.model.quant.auto_mode`)."""
    if mode != "auto":
        return mode
    return _auto_quantization(_gguf_reader(_resolve(spec)), device)


def load_tokenizer(spec: str | None) -> TokenizerBundle:
    """Tokenizer, EOS ids, chat template and limits of `spec`, without loading weights."""
    path = _resolve(spec)
    reader = _gguf_reader(path)
    config = ggufload.gguf_config(reader, path) if reader is not None else load_config(str(path))
    return _tokenizer_bundle(path, config, reader)


def _hf_eos_ids(path: Path, tokenizer: Any) -> list[int]:
    out: list[int] = []
    for file in ("generation_config.json", "config.json"):
        if (path / file).is_file():
            value = _read_json(path / file).get("eos_token_id")
            for v in value if isinstance(value, list) else [value]:
                if v is not None and int(v) not in out:
                    out.append(int(v))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in out:
        out.append(int(tokenizer.eos_token_id))
    return out


def _tokenizer_bundle(path: Path, config: ModelConfig, reader: Any = None) -> TokenizerBundle:
    if path.is_dir():
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:
            raise ModelLoadError(
                f"model directory {path}: cannot load a tokenizer ({exc})"
            ) from None
        eos = _hf_eos_ids(path, tokenizer)
        template = getattr(tokenizer, "chat_template", None)
    else:
        fields = ggufload.read_fields(reader if reader is not None else ggufload.open_reader(path))
        tokenizer = ggufload.cached_tokenizer(path, cache_dir() / "tokenizers")
        eos = gguf_eos_ids(fields) or (
            [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        )
        template = fields.get("tokenizer.chat_template") or getattr(
            tokenizer, "chat_template", None
        )
    return TokenizerBundle(
        tokenizer=tokenizer,
        eos_token_ids=eos,
        chat_template=template if isinstance(template, str) else None,
        name=model_name(path),
        vocab_size=config.vocab_size,
        max_context_len=config.max_position_embeddings,
    )
