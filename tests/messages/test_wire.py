"""The msgspec wire machinery: round trips, arrays for nested items, and a clear error
naming the field path for every kind of bad frame."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from kvserve.wire import MAX_FRAME_BYTES, Codec, Item, Message, WireError


class Entry(Item, frozen=True):
    request_id: int
    tokens: list[int]


class Tag(Item):
    key: str
    weight: float = 1.0
    sources: list[int] = msgspec.field(default_factory=list)


class Batch(Message, frozen=True):
    name: str
    items: list[Entry]
    scale: float = 1.0
    note: str | None = None
    flags: dict[str, bool] = msgspec.field(default_factory=dict)
    tag: Tag | None = None


class Pair(Message):
    request_id: int
    tokens: list[int]


class Ack(Message):
    ok: bool


ACKS = Codec(Ack, direction="reply")
CODEC = Codec(Batch, Pair, direction="request", other=ACKS)


def test_round_trip_nested() -> None:
    msg = Batch(name="b", items=[Entry(1, [1, 2, 3]), Entry(2, [])], scale=2, note=None,
                flags={"x": True})
    out = CODEC.decode(CODEC.encode(msg))
    assert out == Batch(name="b", items=[Entry(1, [1, 2, 3]), Entry(2, [])], scale=2.0,
                        flags={"x": True})
    assert isinstance(out.scale, float)
    tagged = Batch(name="t", items=[], tag=Tag("k", 0.5, [7]))
    assert CODEC.decode(CODEC.encode(tagged)) == tagged
    assert CODEC.decode(CODEC.encode(Pair(3, [4]))) == Pair(3, [4])


def test_messages_are_tagged_maps_and_nested_items_arrays_of_their_fields() -> None:
    frame = CODEC.encode(Batch(name="b", items=[Entry(1, [2])], tag=Tag("k")))
    raw = msgpack.unpackb(frame)
    assert raw["type"] == "Batch"
    assert raw["items"] == [[1, [2]]] and raw["tag"] == ["k", 1.0, []]
    # trailing fields with defaults may be left out of an array
    short = msgpack.packb({"type": "Batch", "name": "b", "items": [], "tag": ["k"]})
    assert CODEC.decode(short).tag == Tag("k")


def test_a_frame_of_the_old_shape_decodes() -> None:
    # The hand-written codec put "type" last and sent every field; msgspec reads it as it is.
    old = msgpack.packb({"name": "b", "items": [[1, [2, 3]]], "scale": 2, "note": None,
                         "flags": {}, "tag": ["k", 0.5, [7]], "type": "Batch"})
    assert CODEC.decode(old) == Batch(name="b", items=[Entry(1, [2, 3])], scale=2.0,
                                      tag=Tag("k", 0.5, [7]))


@pytest.mark.parametrize(
    ("frame", "needle"),
    [
        (b"\xc1garbage", "not a msgpack frame"),
        (b"", "not a msgpack frame"),
        (msgpack.packb([1, 2]), "frame: expected a map, got list"),
        (msgpack.packb({"request_id": 1}), "type: missing field"),
        (msgpack.packb({"type": 3}), "type: expected a string, got int"),
        (msgpack.packb({"type": "Nope"}), "type: unknown message type 'Nope'"),
        (msgpack.packb({"type": "Ack", "ok": True}), "type: Ack is a reply, not a request"),
        (msgpack.packb({"type": "Pair", "request_id": "1", "tokens": []}), "request_id: expected an int, got str"),
        (msgpack.packb({"type": "Pair", "request_id": True, "tokens": []}), "request_id: expected an int, got bool"),
        (msgpack.packb({"type": "Pair", "request_id": 1.0, "tokens": []}), "request_id: expected an int, got float"),
        (msgpack.packb({"type": "Pair", "request_id": 1}), "tokens: missing field"),
        (msgpack.packb({"type": "Pair", "request_id": 1, "tokens": [1, "x"]}), "tokens[1]: expected an int"),
        (msgpack.packb({"type": "Pair", "request_id": 1, "tokens": None}), "tokens: expected a list, got None"),
        (msgpack.packb({"type": "Pair", "request_id": 1, "tokens": [], "extra": 1}),
         "Pair: unknown field 'extra'"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [[1]]}), "items[0].tokens: missing field"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [{"request_id": 1}]}),
         "items[0]: expected an array of Entry fields, got dict"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [[1, [], 3]]}),
         "items[0]: 3 values for the 2 fields of Entry"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [[1, [2, "x"]]]}),
         "items[0].tokens[1]: expected an int, got str"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [[1, []], ["2", []]]}),
         "items[1].request_id: expected an int, got str"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [], "tag": []}), "tag.key: missing field"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [], "tag": ["k", "heavy"]}),
         "tag.weight: expected a number, got str"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [], "tag": ["k", 1.0, [True]]}),
         "tag.sources[0]: expected an int, got bool"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [], "note": 3}),
         "note: expected a string or None, got int"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [], "flags": {"x": 1}}),
         "flags[...]: expected a bool, got int"),
        (msgpack.packb({"type": "Batch", "name": "b", "items": [], "flags": {1: True}}),
         "flags key: expected a string, got int"),
        (msgpack.packb({"type": "Batch", "name": b"b", "items": []}), "name: expected a string, got bytes"),
    ],
)
def test_bad_frames_name_the_problem(frame: bytes, needle: str) -> None:
    with pytest.raises(WireError) as info:
        CODEC.decode(frame)
    assert needle in str(info.value)


def test_float_field_takes_an_int() -> None:
    out = CODEC.decode(msgpack.packb({"type": "Batch", "name": "b", "items": [], "scale": 3}))
    assert out.scale == 3.0 and type(out.scale) is float


def test_oversized_frame_is_refused_before_decoding() -> None:
    with pytest.raises(WireError, match=f"exceeds {MAX_FRAME_BYTES}"):
        CODEC.decode(b"\x00" * (MAX_FRAME_BYTES + 1))


def test_encode_refuses_foreign_message() -> None:
    class Other(Message):
        x: int

    with pytest.raises(TypeError, match="Other is not a message of this codec"):
        CODEC.encode(Other(1))
    with pytest.raises(TypeError):
        CODEC.encode(Ack(True))
