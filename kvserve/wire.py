"""Typed msgpack messages: the one codec every kvserve socket uses.

A message is a dataclass registered in a `Codec`. On the wire it is a msgpack map
``{"type": <tag>, <field>: <value>, ...}``. A dataclass nested inside a message (a field
annotated `Item`, `list[Item]`, `Item | None`, ...) is a msgpack array of its field values
in declaration order; trailing fields that have defaults may be left out.  Arrays keep
the per-item cost of a 64-item step low: no keys to pack, unpack and match.

Decoding checks every field against the dataclass annotations (int, float, str, bool,
bytes, list[...], dict[str, ...], nested dataclasses, ``X | None``) and raises `WireError`
naming the field that is wrong (``grow[3].capacity: expected an int``), so a malformed
frame never reaches handler code. No pickle, ever.

This module knows nothing about what the messages mean.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
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
        if not isinstance(value, (list, tuple)):
            raise WireError(
                f"{where}: expected an array of {tp.__name__} fields, got {type(value).__name__}"
            )
        return codec._from_array(tp, value, where)
    raise WireError(f"{where}: unsupported annotation {tp!r}")


def _to_plain(value: Any) -> Any:
    """A nested value as msgpack takes it: dataclasses become arrays of their fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [_to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


class _Fail(Exception):
    """Raised by a compiled converter; the slow checker then finds and names the problem."""


def _raise_fail() -> Any:
    raise _Fail


def _is_plain(tp: Any) -> bool:
    """True when values of annotation `tp` hold no dataclass (encode them as they are)."""
    if dataclasses.is_dataclass(tp):
        return False
    return all(_is_plain(a) for a in typing.get_args(tp))


_SCALARS: dict[Any, tuple[type, ...]] = {bool: (bool,), int: (int,), str: (str,), bytes: (bytes,)}


def _compile_check(tp: Any, codec: Codec) -> Callable[[Any], Any]:
    """A fast converter for annotation `tp`: returns the value or raises _Fail."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return lambda v: v
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        if len(args) != 1:
            raise _Fail
        inner = _compile_check(args[0], codec)
        if not optional:
            return inner
        return lambda v: None if v is None else inner(v)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        if item in _SCALARS:
            kinds = _SCALARS[item]

            def check_scalar_list(v: Any) -> Any:
                if type(v) is not list or not all(type(x) in kinds for x in v):
                    raise _Fail
                return v

            return check_scalar_list
        if dataclasses.is_dataclass(item):
            return codec._array_list_decoder(item)
        conv = _compile_check(item, codec)

        def check_list(v: Any) -> Any:
            if type(v) is not list:
                raise _Fail
            return [conv(x) for x in v]

        return check_list
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp) or (Any, Any)
        kconv, vconv = _compile_check(key_tp, codec), _compile_check(val_tp, codec)

        def check_dict(v: Any) -> Any:
            if type(v) is not dict:
                raise _Fail
            return {kconv(k): vconv(x) for k, x in v.items()}

        return check_dict
    if tp in _SCALARS:
        kinds = _SCALARS[tp]

        def check_scalar(v: Any) -> Any:
            if type(v) not in kinds:
                raise _Fail
            return v

        return check_scalar
    if tp is float:

        def check_float(v: Any) -> Any:
            if type(v) is float:
                return v
            if type(v) is int:
                return float(v)
            raise _Fail

        return check_float
    if dataclasses.is_dataclass(tp):
        return codec._array_decoder(tp)
    raise _Fail


class Codec(Generic[T]):
    """Encodes and decodes one family of message dataclasses (one per socket link)."""

    def __init__(self, *classes: type) -> None:
        self._by_tag: dict[str, type] = {}
        self._hints: dict[type, dict[str, Any]] = {}
        # Keyed by the message class, or ("array" | "list", cls) for nested dataclasses.
        self._decoders: dict[Any, Callable[[Any], Any]] = {}
        self._encoders: dict[Any, Callable[[Any], Any]] = {}
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

    def _from_array(self, cls: type, raw: list | tuple, where: str) -> Any:
        hints = self._type_hints(cls)
        fields = dataclasses.fields(cls)
        if len(raw) > len(fields):
            raise WireError(f"{where}: {len(raw)} values for the {len(fields)} fields of {cls.__name__}")
        kwargs: dict[str, Any] = {}
        for i, f in enumerate(fields):
            name = f"{where}.{f.name}"
            if i < len(raw):
                kwargs[f.name] = _check(raw[i], hints[f.name], name, self)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise WireError(f"{name}: missing field")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise WireError(f"{where}: {exc}") from exc

    def _array_decoder(self, cls: type) -> Callable[[Any], Any]:
        """The compiled decoder of `cls` nested as an array (raises _Fail when unexpected)."""
        key = ("array", cls)
        dec = self._decoders.get(key)
        if dec is None:
            dec = self._decoders[key] = self._compile_array_decoder(cls)
        return dec

    def _compile_array_decoder(self, cls: type) -> Callable[[Any], Any]:
        """Generate `list -> cls`: every field present is the common, fast case."""
        env, args = self._field_checks(cls, "raw[{i}]")
        fields = dataclasses.fields(cls)
        convs = [env[f"c{i}"] for i in range(len(fields))]
        n_required = sum(
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            for f in fields
        )

        def partial(raw: Any) -> Any:
            if type(raw) is not list or not n_required <= len(raw) <= len(convs):
                raise _Fail
            try:
                return cls(*[conv(v) for conv, v in zip(convs, raw, strict=False)])
            except (TypeError, ValueError):
                raise _Fail from None

        env["partial"] = partial
        src = (
            "def dec(raw):\n"
            f"    if type(raw) is not list or len(raw) != {len(fields)}:\n"
            "        return partial(raw)\n"
            "    try:\n"
            f"        return cls({', '.join(args)})\n"
            "    except (TypeError, ValueError):\n"
            "        raise _Fail from None\n"
        )
        exec(src, env)  # generated from the dataclass's own field names only
        return env["dec"]

    def _array_list_decoder(self, cls: type) -> Callable[[Any], Any]:
        """Compiled decoder of `list[cls]`: one comprehension with the field checks inline."""
        key = ("list", cls)
        dec = self._decoders.get(key)
        if dec is None:
            env, args = self._field_checks(cls, "x[{i}]")
            env["one"] = self._array_decoder(cls)
            n = len(dataclasses.fields(cls))
            src = (
                "def dec(v):\n"
                "    if type(v) is not list:\n"
                "        raise _Fail\n"
                "    try:\n"
                f"        return [cls({', '.join(args)}) if type(x) is list and len(x) == {n}\n"
                "                else one(x) for x in v]\n"
                "    except (TypeError, ValueError):\n"
                "        raise _Fail from None\n"
            )
            exec(src, env)  # generated from the dataclass's own field names only
            dec = self._decoders[key] = env["dec"]
        return dec

    def _field_checks(self, cls: type, access: str) -> tuple[dict[str, Any], list[str]]:
        """Per-field converter expressions over `access` (formatted with i and name)."""
        hints = self._type_hints(cls)
        env: dict[str, Any] = {"_Fail": _Fail, "cls": cls, "fail": _raise_fail}
        args = []
        for i, f in enumerate(dataclasses.fields(cls)):
            env[f"c{i}"] = _compile_check(hints[f.name], self)
            tp, key = hints[f.name], access.format(i=i, name=repr(f.name))
            if tp in _SCALARS and len(_SCALARS[tp]) == 1:
                # Inline the common scalar check: no call per field.
                env[f"t{i}"] = _SCALARS[tp][0]
                args.append(f"({key} if type({key}) is t{i} else fail())")
            else:
                args.append(f"c{i}({key})")
        return env, args

    def _decoder(self, cls: type) -> Callable[[Any], Any]:
        """The compiled decoder of message `cls` (it raises _Fail on anything unexpected)."""
        dec = self._decoders.get(cls)
        if dec is None:
            dec = self._decoders[cls] = self._compile_decoder(cls)
        return dec

    def _compile_decoder(self, cls: type) -> Callable[[Any], Any]:
        """Generate a decoder for `cls`: all fields present is the common, fast case."""
        fields = dataclasses.fields(cls)
        env, args = self._field_checks(cls, "raw[{name}]")
        env["allowed"] = frozenset(f.name for f in fields) | {"type"}
        convs = [(f.name, env[f"c{i}"], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for i, f in enumerate(fields)]

        def partial(raw: dict) -> Any:
            kwargs = {}
            for name, conv, required in convs:
                if name in raw:
                    kwargs[name] = conv(raw[name])
                elif required:
                    raise _Fail
            return cls(**kwargs)

        env["partial"] = partial
        src = (
            "def dec(raw):\n"
            "    if type(raw) is not dict or not allowed.issuperset(raw):\n"
            "        raise _Fail\n"
            "    try:\n"
            f"        return cls({', '.join(args)})\n"
            "    except KeyError:\n"
            "        pass\n"
            "    except (TypeError, ValueError):\n"
            "        raise _Fail from None\n"
            "    try:\n"
            "        return partial(raw)\n"
            "    except (TypeError, ValueError):\n"
            "        raise _Fail from None\n"
        )
        exec(src, env)  # generated from the dataclass's own field names only
        return env["dec"]

    def _plain(self, msg: Any) -> dict:
        enc = self._encoders.get(type(msg))
        if enc is None:
            enc = self._encoders[type(msg)] = self._compile_encoder(type(msg))
        return enc(msg)

    def _array(self, msg: Any) -> list:
        enc = self._encoders.get(("array", type(msg)))
        if enc is None:
            enc = self._encoders[("array", type(msg))] = self._compile_encoder(type(msg), nested=True)
        return enc(msg)

    def _value_exprs(self, cls: type, obj: str) -> list[str]:
        """Expressions giving the wire value of each field of `obj` (an instance of `cls`)."""
        hints = self._type_hints(cls)
        values = []
        for f in dataclasses.fields(cls):
            tp, get = hints[f.name], f"{obj}.{f.name}"
            item = (typing.get_args(tp) or (None,))[0]
            if _is_plain(tp):
                values.append(get)
            elif dataclasses.is_dataclass(tp):
                values.append(f"array({get})")
            elif typing.get_origin(tp) is list and dataclasses.is_dataclass(item):
                if all(_is_plain(t) for t in self._type_hints(item).values()):
                    # A list of flat items (the step's grow/admit/... lists): one comprehension.
                    inner = ", ".join(self._value_exprs(item, "x"))
                    values.append(f"[[{inner}] for x in {get}]")
                else:
                    values.append(f"[array(x) for x in {get}]")
            else:
                values.append(f"_to_plain({get})")
        return values

    def _compile_encoder(self, cls: type, nested: bool = False) -> Callable[[Any], Any]:
        """Generate `msg -> dict` (a message) or `msg -> list` (a nested dataclass)."""
        env: dict[str, Any] = {"array": self._array, "_to_plain": _to_plain}
        values = self._value_exprs(cls, "m")
        if nested:
            body = f"[{', '.join(values)}]"
        else:
            names = [f.name for f in dataclasses.fields(cls)]
            body = "{" + ", ".join(f"{n!r}: {v}" for n, v in zip(names, values, strict=True)) + "}"
        exec(f"def enc(m):\n    return {body}\n", env)
        return env["enc"]

    def encode(self, msg: Any) -> bytes:
        tag = type(msg).__name__
        if self._by_tag.get(tag) is not type(msg):
            raise TypeError(f"{tag} is not a message of this codec")
        body = self._plain(msg)
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
        try:
            return self._decoder(cls)(raw)
        except _Fail:
            pass
        # The slow checker walks the same frame again to name exactly what is wrong.
        return self._from_fields(cls, raw, "")
