"""The real messages of both links on msgspec: every message round trips through the codec
of its direction, frames of the hand-written codec's shape still decode, errors name the
field path, and a frame sent the wrong way is named as such."""

from __future__ import annotations

import re

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.messages import frontend_runner as fr
from kvserve.messages import runner_memsvc as rm
from kvserve.wire import Codec, WireError

_SP = fr.SamplingParams(0.7, 0.9, 40, 0.05, 1.1, 0.2, 0.3, 1234, 77, [1, 2], True, 3)
_LAYOUT = rm.Layout(2, 2, 8, "float32", 256, 1, 8, 64, "cpu", "reserve", 16)
_CUDA = rm.CudaHandle(0, b"\x00\x01h", 4096, 0, b"rc", 8, b"ev", True)

SAMPLES: list[tuple[Codec, object]] = [
    (fr.DOWN, fr.GenerateReq("r1", list(range(50)), _SP, 1.7e9)),
    (fr.DOWN, fr.GenerateReq("r2", [1], fr.SamplingParams())),
    (fr.DOWN, fr.AbortReq("r1")),
    (fr.UP, fr.Hello("runner-0", 4242, 4096)),
    (fr.UP, fr.RunnerStatus("runner-0", 3, 2, 0.25, False)),
    (fr.UP, fr.TokenBatch("runner-0", [
        fr.TokenOut(f"r{i}", [i, i + 1], [fr.TokenLogprob(-0.5, [1, 2], [-0.5, -1.5])],
                    "stop", 2, 0.01, "boom") for i in range(64)])),
    (rm.REQUESTS, rm.Attach("runner-0", 42, "host", 2, 2, 8, "float32")),
    (rm.REPLIES, rm.AttachReply(1 << 61, _LAYOUT, [
        rm.BufferHandle("k_buffer", "memfd", [2, 256, 2, 8], "float32", 16384, 99, 7),
        rm.BufferHandle("v_buffer", "cuda", [2, 256, 2, 8], "float32", 16384, 0, -1, _CUDA)], 0.5, 42)),
    (rm.REQUESTS, rm.Step(lease=1 << 61,
                          admit=[rm.Admit(100 + i, list(range(i, i + 100)), 128) for i in range(8)],
                          grow=[rm.Grow(i, 200) for i in range(64)], commit=[rm.Commit(3, [1, 2, 3])],
                          release=[rm.Release(4), rm.Release(5, [9, 8])])),
    (rm.REPLIES, rm.StepReply([rm.AdmitResult(1, True, 3, 16, 64), rm.AdmitResult(2, False, reason="exhausted")],
                              [rm.GrowResult(1, True, 80), rm.GrowResult(2, False, 0, "exhausted")],
                              ["e1"], 0.3)),
    (rm.REQUESTS, rm.Heartbeat(7)),
    (rm.REPLIES, rm.HeartbeatReply(0.1)),
    (rm.REQUESTS, rm.Detach(7)),
    (rm.REPLIES, rm.DetachReply(3)),
    (rm.REQUESTS, rm.Stats()),
    (rm.REPLIES, rm.StatsReply("reserve", 255, 200, 40, 15, 5, 3, 2, ["a", "b"], 1, 0, 4, 1000, 400, 0.2)),
    (rm.REPLIES, rm.ErrorReply("nope")),
]


@pytest.mark.parametrize(("codec", "msg"), SAMPLES, ids=lambda v: type(v).__name__)
def test_every_message_round_trips_as_a_tagged_map(codec: Codec, msg: object) -> None:
    frame = codec.encode(msg)
    assert codec.decode(frame) == msg
    assert msgpack.unpackb(frame)["type"] == type(msg).__name__


def _old_shape(value: object) -> object:
    """What the hand-written codec sent: fields by name with "type" last, items as arrays."""
    if isinstance(value, list):
        return [_old_shape(v) for v in value]
    fields = getattr(value, "__struct_fields__", None)
    if fields is None:
        return value
    if value.__struct_config__.array_like:
        return [_old_shape(getattr(value, f)) for f in fields]
    return {**{f: _old_shape(getattr(value, f)) for f in fields if f != "protocol"},
            "type": type(value).__name__}


@pytest.mark.parametrize(("codec", "msg"), SAMPLES, ids=lambda v: type(v).__name__)
def test_every_message_decodes_from_the_old_shape(codec: Codec, msg: object) -> None:
    assert codec.decode(msgpack.packb(_old_shape(msg), use_bin_type=True)) == msg


# Frames the hand-written codec (kvserve/wire.py at aee480c) produced, byte for byte: the
# runner<->memsvc link kept its shape (protocol 1) and decodes them.
OLD_FRAMES = [
    (rm.REQUESTS,
     b"\x86\xa5lease\x07\xa5admit\x91\x93\x01\x93\x05\x06\x07\x04\xa4grow\x92\x92\x0c\xcd\x01\x00"
     b"\x92\r\xcd\x01@\xa6commit\x90\xa7release\x91\x92\x02\xc0\xa4type\xa4Step",
     rm.Step(lease=7, admit=[rm.Admit(1, [5, 6, 7], 4)], grow=[rm.Grow(12, 256), rm.Grow(13, 320)],
             release=[rm.Release(2)])),
    (rm.REQUESTS,
     b"\x88\xa4name\xa8runner-0\xa3pid*\xa4host\xa1h\xa8n_layers\x02\xaan_kv_heads\x02\xa8head_dim"
     b"\x08\xa5dtype\xa7float32\xa4type\xa6Attach",
     rm.Attach("runner-0", 42, "h", 2, 2, 8, "float32", protocol=1)),
]


@pytest.mark.parametrize(("codec", "frame", "msg"), OLD_FRAMES, ids=lambda v: type(v).__name__)
def test_frames_of_the_old_codec_decode(codec: Codec, frame: bytes, msg: object) -> None:
    assert codec.decode(frame) == msg


# The frontend<->runner link's protocol 1 frames (aee480c), byte for byte: version 2 renamed
# rid to request_id and dropped fields nobody read, so they are refused, and a version 1
# Hello still says which version it speaks.
V1_FRAMES = [
    (fr.DOWN,
     b"\x85\xa3rid\xa2r1\xa9token_ids\x92\x01\x02\xa6params\x9c\xcb?\xe0\x00\x00\x00\x00\x00\x00"
     b"\xcb?\xf0\x00\x00\x00\x00\x00\x00\x00\xcb\x00\x00\x00\x00\x00\x00\x00\x00\xcb?\xf0\x00\x00"
     b"\x00\x00\x00\x00\xcb\x00\x00\x00\x00\x00\x00\x00\x00\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x03"
     b"\xcc\x80\x91\t\xc2\x00\xacarrival_time\xcb?\xf8\x00\x00\x00\x00\x00\x00\xa4type\xabGenerateReq",
     "unknown field 'rid'"),
    (fr.UP,
     b"\x86\xa9runner_id\xa3r-0\xa3pid*\xa5model\xa1m\xabmax_running\x08\xafmax_context_len@"
     b"\xa4type\xa5Hello",
     "unknown field 'model'"),
    (fr.UP,
     b"\x83\xa9runner_id\xa3r-0\xa7outputs\x91\x99\xa1a\x91\x01\x91\x93\xcb\xbf\xe0\x00\x00\x00\x00"
     b"\x00\x00\x91\x01\x91\xcb\xbf\xe0\x00\x00\x00\x00\x00\x00\xa4stop\x02\x00\x01\xcb\x00\x00\x00"
     b"\x00\x00\x00\x00\x00\xa0\xa4type\xaaTokenBatch",
     "outputs[0].error: expected a string, got int"),
]


@pytest.mark.parametrize(("codec", "frame", "needle"), V1_FRAMES, ids=["GenerateReq", "Hello", "TokenBatch"])
def test_frontend_runner_frames_of_protocol_1_are_refused(codec: Codec, frame: bytes, needle: str) -> None:
    with pytest.raises(WireError, match=re.escape(needle)):
        codec.decode(frame)


def test_a_hello_of_any_version_names_its_version() -> None:
    assert fr.hello_protocol(V1_FRAMES[1][1]) == 1  # version 1 had the field too (Hello at aee480c)
    assert fr.hello_protocol(fr.UP.encode(fr.Hello("r", 1, 1, protocol=7))) == 7
    assert fr.hello_protocol(fr.UP.encode(fr.RunnerStatus("r", 0, 0, 0.0))) is None
    assert fr.hello_protocol(b"\xc1 not msgpack") is None


@pytest.mark.parametrize(
    ("codec", "body", "needle"),
    [
        (rm.REQUESTS, {"type": "Step", "lease": 1, "grow": [[0, 8], [1, 8], [2, 8], [3, "8"]]},
         "grow[3].capacity: expected an int, got str"),
        (rm.REQUESTS, {"type": "Step", "lease": 1, "release": [[1, [2, None]]]},
         "release[0].token_ids[1]: expected an int, got None"),
        (rm.REQUESTS, {"type": "Step", "lease": 1, "admit": [[1, [2]]]}, "admit[0].max_new_tokens: missing field"),
        (rm.REQUESTS, {"type": "Attach", "name": "x"}, "pid: missing field"),
        (rm.REPLIES, {"type": "AttachReply", "lease": 1, "layout": [2, 2, 8], "buffers": []},
         "layout.dtype: missing field"),
        (rm.REPLIES, {"type": "AttachReply", "lease": 1, "layout": list(_LAYOUT.__struct_fields__),
                      "buffers": []}, "layout.n_layers: expected an int, got str"),
        (fr.DOWN, {"type": "GenerateReq", "request_id": "r", "token_ids": [], "params": ["hot"]},
         "params.temperature: expected a number, got str"),
        (fr.UP, {"type": "TokenBatch", "runner_id": "r", "outputs": [["a", [1], [[-0.5, ["x"]]]]]},
         "outputs[0].logprobs[0].top_ids[0]: expected an int, got str"),
        (fr.UP, {"type": "Hello", "runner_id": "r", "pid": 1, "max_context_len": 1, "protocol": "2"},
         "protocol: expected an int, got str"),
        (rm.REQUESTS, {"type": "StatsReply"}, "type: StatsReply is a reply, not a request"),
        (fr.DOWN, {"type": "Hello"}, "type: Hello is a runner→frontend message, not a frontend→runner message"),
        (fr.UP, {"type": "GenerateReq"}, "type: unknown message type 'GenerateReq'"),
    ],
)
def test_errors_name_the_field_path(codec: Codec, body: dict, needle: str) -> None:
    with pytest.raises(WireError) as info:
        codec.decode(msgpack.packb(body))
    assert needle in str(info.value)


def test_hello_and_attach_carry_the_protocol_version() -> None:
    # frontend<->runner version 4: SamplingParams.grammar and logit_bias (3: TokenOut.error_code)
    assert fr.Hello("r", 1, 1).protocol == fr.PROTOCOL_VERSION == 4
    # runner<->memsvc version 3 (2: lease fencing, 3: the "loading" admission of the KV tiers) is
    # sent by MemClient; a frame without it is version 1
    assert rm.PROTOCOL_VERSION == 3 and rm.Attach("r", 1, "h", 1, 1, 1, "float32").protocol == 1
    assert msgpack.unpackb(fr.UP.encode(fr.Hello("r", 1, 1)))["protocol"] == 4


_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
              st.text(max_size=8), st.binary(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)
_CODECS = [rm.REQUESTS, rm.REPLIES, fr.DOWN, fr.UP]
_TAGS = sorted({name for c in _CODECS for name in c.tags} | {"Nope", ""})
_FIELDS = sorted({f for c in _CODECS for cls in c.tags.values() for f in cls.__struct_fields__})


@st.composite
def _frames(draw) -> bytes:
    kind = draw(st.sampled_from(["bytes", "value", "tagged"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "value":
        return msgpack.packb(draw(_values), use_bin_type=True)
    body = draw(st.dictionaries(st.sampled_from(_FIELDS), _values, max_size=6))
    body["type"] = draw(st.sampled_from(_TAGS))
    return msgpack.packb(body, use_bin_type=True)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(frame=_frames(), which=st.sampled_from(range(len(_CODECS))))
def test_any_frame_decodes_or_raises_wire_error(frame: bytes, which: int) -> None:
    codec = _CODECS[which]
    try:
        msg = codec.decode(frame)
    except WireError as exc:
        assert str(exc) and "$" not in str(exc)
    else:
        assert type(msg) in codec.tags.values()


def test_deeply_nested_frame_is_a_wire_error() -> None:
    deep = b"\x91" * 200_000 + b"\x00"
    with pytest.raises(WireError, match="not a msgpack frame: maximum recursion depth"):
        rm.REQUESTS.decode(b"\x82\xa1x" + deep + b"\xa4type\xa4Step")
    with pytest.raises(WireError, match="lease: expected an int, got list"):
        rm.REQUESTS.decode(b"\x82\xa4type\xa4Step\xa5lease" + deep)
