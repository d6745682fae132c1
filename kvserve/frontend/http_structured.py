"""Structured outputs on the HTTP face: the fields that ask for one, as a `kvserve.v1.Constraint`.

The ways a client asks (at most one per request; two are refused by name):
- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`;
- vLLM's `structured_outputs`: one of `json` (a schema, object or JSON text), `regex`, `choice`
  (a list of strings), `grammar` (GBNF / EBNF or Lark), `json_object` (true);
- SGLang's top-level `regex`, `json_schema` (JSON text) and `ebnf`;
- vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

Whether the constraint compiles is checked later, in validation (the same for gRPC). Knows the
OpenAI body models and the proto; nothing about routes or runners.
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.frontend.http_errors import HTTPError, _unsupported
from kvserve.frontend.openai_models import _Sampling
from kvserve.v1 import generator_pb2 as pb

STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}
HARMLESS_KEYS = frozenset(("disable_fallback", "disable_any_whitespace"))
"""structured_outputs keys that change nothing here: there is no fallback backend, and JSON is
always written in one layout (no free whitespace)."""
LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
LEGACY_NAMES = frozenset(LEGACY)


def _bad(param: str, problem: str) -> HTTPError:
    return HTTPError(400, f"{param}: {problem}", param, "invalid_value")


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, bool)):
        return json.dumps(value)
    raise _bad(param, f"a JSON schema is an object (or its JSON text), got {type(value).__name__}")


def _from_kind(kind: str, value: Any, param: str) -> pb.Constraint:
    """One constraint of vLLM's kinds (`STRUCTURED_KEYS`) as the proto's."""
    c = pb.Constraint()
    if kind == "json":
        c.json_schema = _schema_text(value, param)
    elif kind == "json_object":
        if value is not True:
            raise _bad(param, "set it true, or leave it out")
        c.json_object = True
    elif kind == "choice":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _bad(param, "a list of strings")
        c.choice.choices.extend(value)
    else:
        if not isinstance(value, str):
            raise _bad(param, f"a string, got {type(value).__name__}")
        setattr(c, STRUCTURED_KEYS[kind], value)
    return c


def _response_format(rf: dict[str, Any]) -> pb.Constraint | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return pb.Constraint(json_object=True)
    if kind != "json_schema":
        raise _unsupported("response_format.type", f"response_format {kind!r}")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema", "an object with name and schema is required")
    for key in spec:
        if key not in ("name", "schema", "strict", "description"):
            raise _unsupported(f"response_format.json_schema.{key}", repr(key))
    if "schema" not in spec:
        raise _bad("response_format.json_schema.schema", "required")
    return pb.Constraint(json_schema=_schema_text(spec["schema"], "response_format.json_schema.schema"))


def _structured_outputs(so: dict[str, Any]) -> pb.Constraint:
    kinds = [k for k in so if k in STRUCTURED_KEYS and so[k] is not None]
    for key in so:
        if key not in STRUCTURED_KEYS and key not in HARMLESS_KEYS:
            raise _unsupported(f"structured_outputs.{key}", repr(key))
    if len(kinds) != 1:
        raise _bad("structured_outputs", f"give exactly one of {', '.join(STRUCTURED_KEYS)} (got "
                                         f"{', '.join(kinds) or 'none'})")
    return _from_kind(kinds[0], so[kinds[0]], f"structured_outputs.{kinds[0]}")


def constraint(body: _Sampling) -> tuple[str, pb.Constraint] | None:
    """The constraint `body` asks for and the field that asked (None: free text); HTTPError
    naming the field when a field is malformed or two fields ask for one."""
    found: list[tuple[str, pb.Constraint]] = []
    if body.response_format is not None:
        c = _response_format(body.response_format)
        if c is not None:
            found.append(("response_format", c))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(body.structured_outputs)))
    for name, kind in (("regex", "regex"), ("json_schema", "json"), ("ebnf", "grammar")):
        value = getattr(body, name)
        if value is not None:
            found.append((name, _from_kind(kind, value, name)))
    for name, kind in LEGACY.items():
        value = (body.model_extra or {}).get(name)
        if value is not None:
            found.append((name, _from_kind(kind, value, name)))
    if len(found) > 1:
        names = " and ".join(n for n, _ in found)
        raise HTTPError(400, f"{found[1][0]}: {names} each ask for structured output; give one",
                        found[1][0], "invalid_value")
    return found[0] if found else None
