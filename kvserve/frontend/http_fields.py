"""The request fields the HTTP face accepts without using them, and the values at which that is
harmless.

vLLM's, SGLang's and OpenAI's bodies carry fields kvserve has no use for; routers re-serialize
requests and add some at their defaults. Each field named here is accepted, and counted under
its name in kvserve_frontend_http_ignored_fields_total, when its value changes nothing here (the
value kvserve's behaviour already equals, or one that has no effect without another feature);
any other value asks for something kvserve does not do and is refused with a 400 naming the
field. A field not named here is counted as "other" and logged once (as vLLM does).

Knows the OpenAI / vLLM / SGLang field names; nothing about routes or runners.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.frontend.http_errors import _unsupported


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(v is x or (v == x and type(v) is type(x)) for x in values)


def _always(v: Any) -> bool:
    return True


def _empty(v: Any) -> bool:
    return v is None or v in ({}, [], "")


HARMLESS: dict[str, tuple[Callable[[Any], bool], str]] = {
    # the value kvserve's behaviour already is
    "no_stop_trim": (_is(False, None), "keeping the stop string in the output"),
    "include_stop_str_in_output": (_is(False, None), "keeping the stop string in the output"),
    "skip_special_tokens": (_is(True, None), "special tokens in the output text"),
    "add_special_tokens": (_is(False, None), "special tokens added to the prompt (kvserve tokenizes without)"),
    "detokenize": (_is(True, None), "an output without its text"),
    "return_hidden_states": (_is(False, None), "hidden states"),
    "use_beam_search": (_is(False, None), "beam search"),
    "length_penalty": (_is(1, 1.0, None), "a beam search length penalty"),
    "min_tokens": (_is(0, None), "min_tokens"),
    "priority": (_is(0, None), "request priorities"),
    "truncate_prompt_tokens": (_is(None), "prompt truncation"),
    "chat_template_kwargs": (_empty, "chat template arguments"),
    "documents": (_empty, "documents for the chat template"),
    "lora_path": (_empty, "LoRA adapters"),
    "lora_name": (_empty, "LoRA adapters"),
    "cache_salt": (_empty, "a prefix cache isolated by salt"),
    "session_params": (_empty, "SGLang sessions"),
    "store": (_is(False, None), "stored completions"),
    "allowed_token_ids": (_empty, "a vocabulary limited to some ids (logit_bias can ban tokens)"),
    "bad_words": (_empty, "banned words"),
    "prompt_logprobs": (_is(None), "the prompt's logprobs"),
    "guided_whitespace_pattern": (_is(None), "a whitespace pattern for JSON (kvserve writes one layout)"),
    # no effect here whatever the value
    "spaces_between_special_tokens": (_always, ""),  # special tokens are skipped: no spaces to put
    "separate_reasoning": (_always, ""),  # no reasoning parser: the reply is the text as written
    "stream_reasoning": (_always, ""),
    "include_reasoning": (_always, ""),
    "user": (_always, ""),  # an end user's id, for the client's own tracking
    "metadata": (_always, ""),  # only with store
    "service_tier": (_always, ""),  # one tier here
    "request_id": (_always, ""),  # the x-request-id header names a request here
    "rid": (_always, ""),
    "guided_decoding_backend": (_always, ""),  # a grammar library's name: llguidance serves every one
}


def check_extra(name: str, value: Any) -> str:
    """The label `name` counts under ("other" for a field not in `HARMLESS`); HTTPError when
    its value asks for what kvserve does not do."""
    entry = HARMLESS.get(name)
    if entry is None:
        return "other"
    harmless, what = entry
    if not harmless(value):
        raise _unsupported(name, f"{name}={value!r} ({what})")
    return name
