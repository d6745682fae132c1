"""Messages between the gRPC frontend and the runner workers (ZMQ, msgpack via msgspec).

Topology: the frontend binds a ROUTER socket (``ipc://<runtime>/frontend.sock`` by
default); each runner connects a DEALER whose identity is its ``runner_id`` and says
`Hello` first, then `RunnerStatus` at least every `STATUS_INTERVAL_S` seconds and its
`Hello` again every `HELLO_INTERVAL_S` (so that a restarted frontend learns of it).

Down (frontend -> runner): `GenerateReq`, `AbortReq`.
Up (runner -> frontend): `Hello`, `RunnerStatus`, `TokenBatch` (one per scheduler step,
carrying the new tokens of every request in the batch).

Token ids only cross this link; text (tokenize, detokenize, stop strings) stays in the
frontend. `DOWN` decodes what a runner receives, `UP` what the frontend receives (shape:
`kvserve.wire`). A change of shape bumps `PROTOCOL_VERSION`, which `Hello` carries; the
frontend ignores a runner of another version (version 2: request ids are `request_id`,
`Hello` lost `model` and `max_running`, `TokenOut` lost `prompt_tokens` and
`completion_tokens`: nothing read them; version 3: `TokenOut.error_code`, which a
version-2 frontend cannot decode; version 4: `SamplingParams.grammar` and `logit_bias`, which a
version-3 runner would drop, giving unconstrained text).
"""

from __future__ import annotations

import msgspec

from kvserve.wire import Codec, Item, Message

HELLO_INTERVAL_S = 1.0
"""A runner repeats its Hello this often; a frontend that knows the runner's pid only
refreshes it, one that does not (restarted, or it dropped a stalled runner) registers it."""
STATUS_INTERVAL_S = 0.25
"""A runner sends RunnerStatus at least this often; the frontend declares it dead after
`RUNNER_TIMEOUT_S` of silence (or at once when its local pid is gone)."""
RUNNER_TIMEOUT_S = 1.5

PROTOCOL_VERSION = 4
"""The shape of this link's messages; `Hello.protocol` carries the runner's."""

GREEDY_TEMPERATURE = 1e-5
"""A temperature below this samples greedily (the argmax), in the runner and as the
frontend accepts it: dividing logits by, say, 1e-40 overflows float32."""


def hello_protocol(frame: bytes) -> int | None:
    """The protocol version a `Hello` frame of any version says it speaks (None: the frame
    is not a Hello), so that a runner of another version is refused by name."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(raw, dict) or raw.get("type") != "Hello":
        return None
    version = raw.get("protocol", 1)  # version 1 runners sent it too; absent means 1
    return version if type(version) is int else None


class FinishReason:
    """Values of `TokenOut.finish_reason` ("" while the request goes on)."""

    STOP = "stop"  # EOS or a stop token id (stop strings are the frontend's)
    LENGTH = "length"  # max_new_tokens or the context length reached
    ABORT = "abort"  # aborted by the frontend
    ERROR = "error"  # failed in the runner (memsvc gone, internal error): see TokenOut.error


class ErrorCode:
    """Values of `TokenOut.error_code`: the gRPC status a failed request ends with."""

    UNAVAILABLE = ""  # the runner or memsvc is in trouble; a retry may pass
    INTERNAL = "INTERNAL"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"


class SamplingParams(Item, frozen=True, gc=False):
    """Per-request sampling. The frontend validates ranges before sending."""

    temperature: float = 0.0  # below GREEDY_TEMPERATURE (e.g. 0) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int = 0  # top-n logprobs per sampled token; 0 = none
    grammar: str = ""  # llguidance grammar text (kvserve.model.grammars) the output must match; "" = none
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)  # token id -> added to its logit


class GenerateReq(Message, frozen=True, gc=False):
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0  # time.time() at the frontend, for queue-time metrics


class AbortReq(Message, frozen=True, gc=False):
    request_id: str


class Hello(Message, frozen=True):
    runner_id: str
    pid: int
    max_context_len: int
    protocol: int = PROTOCOL_VERSION


class RunnerStatus(Message, frozen=True, gc=False):
    runner_id: str
    running: int
    waiting: int
    kv_usage: float  # fraction of the memsvc pool in use, 0..1
    memsvc_ok: bool = True  # False while the runner has no live memsvc attachment


class TokenLogprob(Item, frozen=True, gc=False):
    """Logprob of one sampled token and the top-n alternatives at that position."""

    logprob: float
    top_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)


class TokenOut(Item, frozen=True, gc=False):
    """New output of one request in one step."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    finish_reason: str = ""
    cached_tokens: int = 0
    queue_time: float = 0.0  # seconds from arrival to first scheduling (first TokenOut only)
    error: str = ""
    # With finish_reason "error": the gRPC status name the client gets. "" = UNAVAILABLE (the
    # runner or memsvc is in trouble, a retry may pass), "INTERNAL" (a fault such as NaN
    # logits), "INVALID_ARGUMENT" (the runner refused a field; `error` names it).
    error_code: str = ""


class TokenBatch(Message, frozen=True, gc=False):
    runner_id: str
    outputs: list[TokenOut]


ToRunner = GenerateReq | AbortReq
ToFrontend = Hello | RunnerStatus | TokenBatch

UP: Codec[ToFrontend] = Codec(Hello, RunnerStatus, TokenBatch,
                              direction="runner→frontend message")
DOWN: Codec[ToRunner] = Codec(GenerateReq, AbortReq, direction="frontend→runner message",
                              other=UP)
