"""Check a `kvserve.v1.GenerateRequest` and turn it into prompt ids + runner sampling params.

Every rejection is an `InvalidArgument` whose message starts with the field's path
(``sampling.top_p: ...``), which the frontend returns as gRPC INVALID_ARGUMENT before
anything is allocated. Knows the proto and the tokenizer, nothing about runners or I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.config.frontend import FrontendConfig
from kvserve.frontend.chat_input import (
    InvalidArgument,
    chat_chars,
    template_messages,
    template_tools,
)
from kvserve.messages.frontend_runner import SamplingParams
from kvserve.model.grammars import GrammarCache, GrammarError, llg_tokenizer
from kvserve.model.tokenizer import ChatTemplateError, FrontendTokenizer
from kvserve.v1 import generator_pb2 as pb

MAX_LOGPROBS = 20
MAX_REQUEST_ID_LEN = 256
MAX_LOGIT_BIAS = 1024
"""Token ids one request's logit_bias may name."""
LOGIT_BIAS_RANGE = 100.0
"""A bias is in [-100, 100], as OpenAI takes it."""
_GRAMMARS: dict[int, tuple[FrontendTokenizer, GrammarCache]] = {}


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request, ready to route."""

    prompt_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]


def check_ids(ids: list[int], vocab_size: int, field: str) -> None:
    for i, tid in enumerate(ids):
        if tid >= vocab_size:
            raise InvalidArgument(f"{field}[{i}]", f"token id {tid} is out of vocabulary (size {vocab_size})")


def _check_chars(n: int, cfg: FrontendConfig, field: str) -> None:
    if n > cfg.max_prompt_chars:
        raise InvalidArgument(field, f"{n} characters is longer than the limit of {cfg.max_prompt_chars} "
                                     "(max_prompt_chars)")


def prompt_ids(prompt: pb.GenerateRequest | pb.TokenizeRequest, tok: FrontendTokenizer, cfg: FrontendConfig,
               oneof: str = "prompt") -> list[int]:
    """Tokenize the request's text / token_ids / chat; raise InvalidArgument when it is empty, bad
    or past a size limit (checked before tokenizing, so a huge input costs no tokenizer time)."""
    kind = prompt.WhichOneof(oneof)
    if kind is None:
        raise InvalidArgument(oneof, "empty: set text, token_ids or chat")
    if kind == "text":
        if not prompt.text:
            raise InvalidArgument(f"{oneof}.text", "empty prompt")
        _check_chars(len(prompt.text), cfg, f"{oneof}.text")
        ids = tok.encode(prompt.text)
    elif kind == "token_ids":
        ids = list(prompt.token_ids.ids)
        if not ids:
            raise InvalidArgument(f"{oneof}.token_ids", "empty prompt")
        check_ids(ids, tok.vocab_size, f"{oneof}.token_ids")
    else:
        msgs = prompt.chat.messages
        if not msgs:
            raise InvalidArgument(f"{oneof}.chat.messages", "empty chat")
        if len(msgs) > cfg.max_chat_messages:
            raise InvalidArgument(f"{oneof}.chat.messages", f"{len(msgs)} messages is more than the limit of "
                                                            f"{cfg.max_chat_messages} (max_chat_messages)")
        _check_chars(chat_chars(prompt.chat), cfg, f"{oneof}.chat")
        messages = template_messages(prompt.chat, f"{oneof}.chat")
        tools = template_tools(prompt.chat, f"{oneof}.chat")
        if not tok.has_chat_template:
            raise InvalidArgument(f"{oneof}.chat", "the model has no chat template; send text instead")
        if tools and not tok.renders_tools:
            raise InvalidArgument(f"{oneof}.chat.tools", "the model's chat template does not show the model "
                                                         "any tools (it never reads `tools`)")
        add_gen = prompt.chat.add_generation_prompt if prompt.chat.HasField("add_generation_prompt") else True
        try:
            ids = tok.render_chat(messages, add_gen, tools)
        except ChatTemplateError as exc:  # the template refused this chat (raise_exception)
            raise InvalidArgument(f"{oneof}.chat", str(exc)) from None
    if not ids:
        raise InvalidArgument(oneof, "the prompt tokenizes to no tokens")
    return ids


def _finite(value: float, field: str) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(field, f"must be a finite number, got {value}")
    return value


def sampling_params(s: pb.SamplingParams, tok: FrontendTokenizer, cfg: FrontendConfig) -> SamplingParams:
    """Apply defaults to `s` and check every range; raise InvalidArgument naming the field."""

    def opt(name: str, default: float) -> float:
        return getattr(s, name) if s.HasField(name) else default

    # Any finite temperature >= 0 is taken; below GREEDY_TEMPERATURE (e.g. 1e-40) the
    # runner samples greedily, which is what such a temperature tends to.
    temperature = _finite(opt("temperature", 0.0), "sampling.temperature")
    if temperature < 0:
        raise InvalidArgument("sampling.temperature", f"must be >= 0, got {temperature}")
    top_p = _finite(opt("top_p", 1.0), "sampling.top_p")
    if not 0 < top_p <= 1:
        raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {top_p}")
    top_k = int(opt("top_k", 0))
    if top_k < 0:
        raise InvalidArgument("sampling.top_k", f"must be >= 0 (0 = off), got {top_k}")
    min_p = _finite(opt("min_p", 0.0), "sampling.min_p")
    if not 0 <= min_p <= 1:
        raise InvalidArgument("sampling.min_p", f"must be in [0, 1], got {min_p}")
    rep = _finite(opt("repetition_penalty", 1.0), "sampling.repetition_penalty")
    if rep <= 0:
        raise InvalidArgument("sampling.repetition_penalty", f"must be > 0, got {rep}")
    presence = _finite(opt("presence_penalty", 0.0), "sampling.presence_penalty")
    frequency = _finite(opt("frequency_penalty", 0.0), "sampling.frequency_penalty")
    max_new = int(opt("max_new_tokens", min(cfg.default_max_new_tokens, cfg.max_new_tokens_cap)))
    if not 0 < max_new <= cfg.max_new_tokens_cap:
        raise InvalidArgument(
            "sampling.max_new_tokens", f"must be in 1..{cfg.max_new_tokens_cap}, got {max_new}"
        )
    if len(s.stop) > cfg.max_stop_strings:
        raise InvalidArgument("sampling.stop", f"too many stop strings: {len(s.stop)} > {cfg.max_stop_strings} "
                                               "(max_stop_strings)")
    for i, stop in enumerate(s.stop):
        if not stop:
            raise InvalidArgument(f"sampling.stop[{i}]", "empty stop string")
        if len(stop) > cfg.max_stop_len:
            raise InvalidArgument(f"sampling.stop[{i}]", f"longer than {cfg.max_stop_len} characters "
                                                         "(max_stop_len)")
    if len(s.stop_token_ids) > cfg.max_stop_token_ids:
        raise InvalidArgument("sampling.stop_token_ids", f"too many stop token ids: {len(s.stop_token_ids)} > "
                                                          f"{cfg.max_stop_token_ids} (max_stop_token_ids)")
    check_ids(list(s.stop_token_ids), tok.vocab_size, "sampling.stop_token_ids")
    if not 0 <= s.logprobs <= MAX_LOGPROBS:
        raise InvalidArgument("sampling.logprobs", f"must be in 0..{MAX_LOGPROBS}, got {s.logprobs}")
    bias = logit_bias(s, tok.vocab_size)
    grammar = constraint_grammar(s, tok, cfg) if s.HasField("constraint") else ""
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency,
        seed=int(s.seed) if s.HasField("seed") else None, max_new_tokens=max_new,
        stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos, logprobs=int(s.logprobs),
        grammar=grammar, logit_bias=bias,
    )


def logit_bias(s: pb.SamplingParams, vocab_size: int) -> dict[int, float]:
    """`s.logit_bias`, every id in the vocabulary and every bias in [-100, 100]."""
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument("sampling.logit_bias", f"{len(s.logit_bias)} token ids is more than the limit "
                                                     f"of {MAX_LOGIT_BIAS}")
    for tid, bias in s.logit_bias.items():
        if tid >= vocab_size:
            raise InvalidArgument(f"sampling.logit_bias[{tid}]", f"token id {tid} is out of vocabulary "
                                                                f"(size {vocab_size})")
        if not (math.isfinite(bias) and -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE):
            raise InvalidArgument(f"sampling.logit_bias[{tid}]", f"must be in [-100, 100], got {bias}")
    return dict(s.logit_bias)


def grammar_cache(tok: FrontendTokenizer) -> GrammarCache:
    """The constraint cache of `tok` (built at the first constrained request: about 0.2 s)."""
    entry = _GRAMMARS.get(id(tok))
    if entry is None or entry[0] is not tok:
        cache = GrammarCache(llg_tokenizer(tok.backend.to_str(), tok.vocab_size, list(tok.eos_token_ids)))
        entry = _GRAMMARS[id(tok)] = (tok, cache)
    return entry[1]


def constraint_grammar(s: pb.SamplingParams, tok: FrontendTokenizer, cfg: FrontendConfig) -> str:
    """The grammar text of `s.constraint`, compiled (or its verdict cached); InvalidArgument
    naming the constraint's field and what the compiler refused."""
    kind = s.constraint.WhichOneof("kind")
    field = f"sampling.constraint.{kind}"
    if kind is None:
        raise InvalidArgument("sampling.constraint", "empty: set json_schema, json_object, regex, choice or grammar")
    value: object = getattr(s.constraint, kind)
    if kind == "json_object" and not value:
        raise InvalidArgument(field, "set it true, or leave the constraint unset")
    if kind == "choice":
        value = list(s.constraint.choice.choices)
    size = sum(map(len, value)) if isinstance(value, list) else len(value) if isinstance(value, str) else 0
    if size > cfg.max_constraint_chars:
        raise InvalidArgument(field, f"{size} characters is longer than the limit of {cfg.max_constraint_chars} "
                                     "(max_constraint_chars)")
    try:
        return grammar_cache(tok).grammar(kind, value)
    except GrammarError as exc:
        raise InvalidArgument(field, f"cannot be compiled: {exc}") from None


def prepare(req: pb.GenerateRequest, tok: FrontendTokenizer, cfg: FrontendConfig,
            context_len: int) -> Prepared:
    """Validate `req` fully (sampling first: it is cheap) and tokenize its prompt."""
    if len(req.request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidArgument("request_id", f"longer than {MAX_REQUEST_ID_LEN} characters")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in req.request_id):
        raise InvalidArgument("request_id", "holds a control character")
    params = sampling_params(req.sampling, tok, cfg)
    ids = prompt_ids(req, tok, cfg)
    limit = context_len - 1
    if cfg.max_prompt_tokens:
        limit = min(limit, cfg.max_prompt_tokens)
    if len(ids) > limit:
        raise InvalidArgument(
            "prompt", f"{len(ids)} tokens is longer than the limit of {limit} (context length {context_len})"
        )
    return Prepared(prompt_ids=ids, params=params, stops=tuple(req.sampling.stop))
