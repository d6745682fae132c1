"""Typed msgpack messages: the one codec every kvserve socket uses.

A message is a frozen dataclass registered in a `Codec`. On the wire it is a msgpack map
``{"type": <tag>, <field>: <value>, ...}``. Decoding checks every field against the
dataclass annotations (int, float, str, bool, bytes, list[...], dict[str, ...], nested
message dataclasses, ``X | None``) and raises `WireError` naming the field that is wrong,
so a malformed frame never reaches handler code. No pickle, ever.

This module knows nothing about what the messages mean.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Generic, TypeVar

import msgpack

T = TypeVar("T")

MAX_FRAME_BYTES = 64 * 1024 * 1024


class WireError(ValueError):
    """A frame that cannot be decoded into a registered message."""


def _check(value: Any, tp: Any, where: str, codec: Codec) -> Any:
    """Return `value` converted to annotation `tp`, or raise WireError naming `where`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(value, arg, where, codec)
            except WireError as exc:
                errors.append(str(exc))
        raise WireError(errors[0] if len(errors) == 1 else f"{where}: wrong type {type(value).__name__}")
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise WireError(f"{where}: expected a list, got {type(value).__name__}")
        if item_tp is int and all(type(v) is int for v in value):
            return list(value)
        return [_check(v, item_tp, f"{where}[{i}]", codec) for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp) or (Any, Any)
        if not isinstance(value, dict):
            raise WireError(f"{where}: expected a map, got {type(value).__name__}")
        return {
            _check(k, key_tp, f"{where} key", codec): _check(v, val_tp, f"{where}[{k!r}]", codec)
            for k, v in value.items()
        }
    if tp is bool:
        if type(value) is not bool:
            raise WireError(f"{where}: expected a bool, got {type(value).__name__}")
        return value
    if tp is int:
        if type(value) is not int:
            raise WireError(f"{where}: expected an int, got {type(value).__name__}")
        return value
    if tp is float:
        if type(value) not in (int, float):
            raise WireError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise WireError(f"{where}: expected a string, got {type(value).__name__}")
        return value
    if tp is bytes:
        if not isinstance(value, (bytes, bytearray)):
            raise WireError(f"{where}: expected bytes, got {type(value).__name__}")
        return bytes(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise WireError(f"{where}: expected a map for {tp.__name__}, got {type(value).__name__}")
        return codec._from_fields(tp, value, where)
    raise WireError(f"{where}: unsupported annotation {tp!r}")


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


class Codec(Generic[T]):
    """Encodes and decodes one family of message dataclasses (one per socket link)."""

    def __init__(self, *classes: type) -> None:
        self._by_tag: dict[str, type] = {}
        self._hints: dict[type, dict[str, Any]] = {}
        for cls in classes:
            self.register(cls)

    def register(self, cls: type) -> type:
        """Add a top-level message class; its tag is the class name."""
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} is not a dataclass")
        self._by_tag[cls.__name__] = cls
        return cls

    def _type_hints(self, cls: type) -> dict[str, Any]:
        hints = self._hints.get(cls)
        if hints is None:
            hints = typing.get_type_hints(cls)
            self._hints[cls] = hints
        return hints

    def _from_fields(self, cls: type, raw: dict, where: str) -> Any:
        hints = self._type_hints(cls)
        kwargs: dict[str, Any] = {}
        known = set()
        for f in dataclasses.fields(cls):
            known.add(f.name)
            name = f"{where}.{f.name}" if where else f.name
            if f.name in raw:
                kwargs[f.name] = _check(raw[f.name], hints[f.name], name, self)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise WireError(f"{name}: missing field")
        extra = set(raw) - known - {"type"}
        if extra:
            raise WireError(f"{where or cls.__name__}: unknown field {sorted(map(str, extra))[0]!r}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise WireError(f"{where or cls.__name__}: {exc}") from exc

    def encode(self, msg: Any) -> bytes:
        tag = type(msg).__name__
        if self._by_tag.get(tag) is not type(msg):
            raise TypeError(f"{tag} is not a message of this codec")
        body = _to_plain(msg)
        body["type"] = tag
        return msgpack.packb(body, use_bin_type=True)

    def decode(self, frame: bytes) -> Any:
        """Decode one frame; raise WireError naming what is wrong."""
        if len(frame) > MAX_FRAME_BYTES:
            raise WireError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
        try:
            raw = msgpack.unpackb(frame, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise WireError(f"not a msgpack frame: {exc}") from None
        if not isinstance(raw, dict):
            raise WireError(f"frame is a {type(raw).__name__}, expected a map")
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise WireError("type: missing or not a string")
        cls = self._by_tag.get(tag)
        if cls is None:
            raise WireError(f"type: unknown message type {tag!r}")
        return self._from_fields(cls, raw, "")
