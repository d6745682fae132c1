"""The typed msgpack codec: round trips, and a clear error for every kind of bad frame."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import pytest

from kvserve.wire import Codec, WireError


@dataclass(frozen=True, slots=True)
class Item:
    rid: int
    tokens: list[int]


@dataclass(slots=True)
class Tag:
    key: str
    weight: float = 1.0
    sources: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Batch:
    name: str
    items: list[Item]
    scale: float = 1.0
    note: str | None = None
    flags: dict[str, bool] = field(default_factory=dict)
    tag: Tag | None = None


CODEC = Codec(Batch, Item)


def test_round_trip_nested() -> None:
    msg = Batch(name="b", items=[Item(1, [1, 2, 3]), Item(2, [])], scale=2, note=None,
                flags={"x": True})
    out = CODEC.decode(CODEC.encode(msg))
    assert out == Batch(name="b", items=[Item(1, [1, 2, 3]), Item(2, [])], scale=2.0,
                        flags={"x": True})
    assert isinstance(out.scale, float)
    tagged = Batch(name="t", items=[], tag=Tag("k", 0.5, [7]))
    assert CODEC.decode(CODEC.encode(tagged)) == tagged


def test_nested_dataclasses_are_arrays_of_their_fields() -> None:
    frame = CODEC.encode(Batch(name="b", items=[Item(1, [2])], tag=Tag("k")))
    raw = msgpack.unpackb(frame)
    assert raw["items"] == [[1, [2]]] and raw["tag"] == ["k", 1.0, []]
    # trailing fields with defaults may be left out
    short = msgpack.packb({"type": "Batch", "name": "b", "items": [], "tag": ["k"]})
    assert CODEC.decode(short).tag == Tag("k")


@pytest.mark.parametrize(
    ("frame", "needle"),
    [
        (b"\xc1garbage", "not a msgpack frame"),
        (msgpack.packb([1, 2]), "expected a map"),
        (msgpack.packb({"rid": 1}), "type: missing"),
        (msgpack.packb({"type": "Nope"}), "unknown message type 'Nope'"),
        (msgpack.packb({"type": "Item", "rid": "1", "tokens": []}), "rid: expected an int"),
        (msgpack.packb({"type": "Item", "rid": True, "tokens": []}), "rid: expected an int"),
        (msgpack.packb({"type": "Item", "rid": 1}), "tokens: missing field"),
        (msgpack.packb({"type": "Item", "rid": 1, "tokens": [1, "x"]}), "tokens[1]: expected an int"),
        (msgpack.packb({"type": "Item", "rid": 1, "tokens": [], "extra": 1}), "unknown field 'extra'"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [[1]]}), "items[0].tokens: missing"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [{"rid": 1}]}),
         "items[0]: expected an array of Item fields, got dict"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [[1, [], 3]]}),
         "items[0]: 3 values for the 2 fields of Item"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [[1, [2, "x"]]]}),
         "items[0].tokens[1]: expected an int"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [], "tag": []}), "tag.key: missing field"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [], "tag": ["k", "heavy"]}),
         "tag.weight: expected a number"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [], "note": 3}), "note: expected a string"),
    ],
)
def test_bad_frames_name_the_problem(frame: bytes, needle: str) -> None:
    with pytest.raises(WireError) as info:
        CODEC.decode(frame)
    assert needle in str(info.value)


def test_encode_refuses_foreign_message() -> None:
    @dataclass
    class Other:
        x: int

    with pytest.raises(TypeError):
        CODEC.encode(Other(1))
