"""Typed msgpack messages on msgspec: the base classes and the codec every kvserve link uses.

A top-level message subclasses `Message` (a `msgspec.Struct` tagged by its class name): on
the wire a msgpack map ``{"type": <class name>, <field>: <value>, ...}``. A struct nested
inside a message subclasses `Item`: a msgpack array of its field values in declaration
order, where trailing fields that have defaults may be left out (no keys to pack, unpack
and match in a 64-item step).

A `Codec` holds one msgspec decoder for the messages one side of a socket receives and
one encoder. Decoding validates every field against its annotation as it parses (an int
is never a bool, a float field takes an int; unknown fields and surplus array values are
errors) and raises `WireError` naming the field by its path of names
(``grow[3].capacity: expected an int, got str``), so a malformed frame never reaches
handler code. No pickle, ever.

This module knows nothing about what the messages mean.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")

MAX_FRAME_BYTES = 64 * 1024 * 1024


class WireError(ValueError):
    """A frame that cannot be decoded into one of a codec's messages."""


class Message(msgspec.Struct, tag_field="type", tag=True, forbid_unknown_fields=True):
    """Base of top-level messages: a map tagged ``"type": <class name>``."""


class Item(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Base of structs nested in messages: an array of field values in declaration order."""


class _Tag(msgspec.Struct):
    type: Any = None


class Codec(Generic[T]):
    """Encodes the messages of one link and decodes those one side of it receives.

    `direction` names what this side receives ("request"); `other` is the codec of the
    opposite direction, so that a frame sent the wrong way is named as such.
    """

    def __init__(self, *classes: type[Message], direction: str = "message",
                 other: Codec[Any] | None = None) -> None:
        self.direction = direction
        self.tags = {cls.__name__: cls for cls in classes}
        self._other = other
        self._decoder = msgspec.msgpack.Decoder(typing.Union[classes])  # noqa: UP007
        self._encoder = msgspec.msgpack.Encoder()
        self._tag = msgspec.msgpack.Decoder(_Tag)  # reads only "type", to explain an error

    def encode(self, msg: Message) -> bytes:
        if self.tags.get(type(msg).__name__) is not type(msg):
            raise TypeError(f"{type(msg).__name__} is not a message of this codec")
        return self._encoder.encode(msg)

    def decode(self, frame: bytes) -> T:
        """Decode one frame; raise WireError naming what is wrong."""
        if len(frame) > MAX_FRAME_BYTES:
            raise WireError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
        try:
            return self._decoder.decode(frame)
        except msgspec.ValidationError as exc:
            raise WireError(self._explain(str(exc), frame)) from None
        except (msgspec.DecodeError, RecursionError) as exc:
            raise WireError(f"not a msgpack frame: {exc}") from None

    def _explain(self, text: str, frame: bytes) -> str:
        """msgspec's message with its ``$.grow[3][1]`` path spelled ``grow[3].capacity``."""
        what, _, where = text.partition(" - at `")
        key = where.startswith("key` in `")
        segments = _SEGMENT.findall(where.removeprefix("key` in `").rstrip("`")[1:])
        try:
            tag = self._tag.decode(frame).type
        except (msgspec.DecodeError, RecursionError):
            tag = None
        root = self.tags.get(tag) if isinstance(tag, str) else None
        if segments == [("type", "")] and isinstance(tag, str):
            if self._other is not None and tag in self._other.tags:
                return f"type: {tag} is a {self._other.direction}, not a {self.direction}"
            return f"type: unknown message type {tag!r}"
        path, tp = _walk(root, segments)
        where = path or (root.__name__ if root is not None else "frame")
        if key:
            return f"{where} key: {_phrase(what)}"
        return _describe(path, where, tp, what)


_SEGMENT = re.compile(r"\.(\w+)|\[(\d+|\.\.\.)\]")
_EXPECTED = {"int": "an int", "float": "a number", "str": "a string", "bool": "a bool",
             "bytes": "bytes", "array": "a list", "object": "a map", "null": "None"}
_GOT = {"array": "list", "object": "dict", "null": "None"}
_TYPE_ERROR = re.compile(r"Expected `([^`]+)`, got `([^`]+)`$")
_LENGTH = re.compile(r"Expected `array` of at (least|most) length (\d+), got (\d+)$")
_FIELD = re.compile(r"Object (missing required|contains unknown) field `([^`]+)`$")


def _unwrap(tp: Any) -> Any:
    """`X | None` -> X; anything else as it is."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _is_array(tp: Any) -> bool:
    """True for a struct that travels as an array of its fields."""
    return _is_struct(tp) and tp.__struct_config__.array_like


def _walk(root: type | None, segments: list[tuple[str, str]]) -> tuple[str, Any]:
    """Field path (names, list indexes) of msgspec's path segments, and the type found there."""
    path, tp = "", root
    for name, index in segments:
        tp = _unwrap(tp)
        fields = msgspec.structs.fields(tp) if _is_struct(tp) else ()
        if name:
            path = f"{path}.{name}" if path else name
            tp = next((f.type for f in fields if f.name == name), None)
        elif _is_array(tp) and index.isdigit() and int(index) < len(fields):
            field = fields[int(index)]
            path, tp = f"{path}.{field.name}", field.type
        else:
            path = f"{path}[{index}]"
            args = typing.get_args(tp)
            tp = args[-1] if args else None
    return path, _unwrap(tp)


def _phrase(what: str) -> str:
    """``Expected `int`, got `str``` -> ``expected an int, got str``."""
    m = _TYPE_ERROR.match(what)
    if m is None:
        return what[:1].lower() + what[1:]
    expected = " or ".join(_EXPECTED.get(t, t) for t in m.group(1).split(" | "))
    return f"expected {expected}, got {_GOT.get(m.group(2), m.group(2))}"


def _describe(path: str, where: str, tp: Any, what: str) -> str:
    """One error in plain words, at `path` (a value of type `tp`; `where` names it)."""
    m = _FIELD.match(what)
    if m is not None:
        if m.group(1) == "missing required":
            return f"{path + '.' if path else ''}{m.group(2)}: missing field"
        return f"{where}: unknown field {m.group(2)!r}"
    if _is_array(tp):
        fields = msgspec.structs.fields(tp)
        m = _LENGTH.match(what)
        if m is not None and m.group(1) == "least":
            return f"{where}.{fields[int(m.group(3))].name}: missing field"
        if m is not None:
            return f"{where}: {m.group(3)} values for the {len(fields)} fields of {tp.__name__}"
        m = _TYPE_ERROR.match(what)
        if m is not None and m.group(1) == "array":
            return f"{where}: expected an array of {tp.__name__} fields, got {_GOT.get(m.group(2), m.group(2))}"
    return f"{where}: {_phrase(what)}"
