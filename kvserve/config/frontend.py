"""`FrontendConfig`: the frozen configuration of the gRPC frontend (`kvserve frontend`, the
[frontend] table, KVSERVE_* variables).

Range checks live in ``__post_init__`` and raise ConfigError naming the field. This module
knows nothing about gRPC, ZMQ or processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ConfigError, option
from kvserve.config.checks import check_address, check_kv_events, check_port, check_positive

# the tool-call formats kvserve reads (kvserve.model.tool_parsers implements each)
FAMILY_NAMES = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    """Everything `kvserve frontend` needs; defaults match docs/interfaces.md."""

    model: str = option("", help="model: a HF directory, a .gguf file, or '' for the embedded default")
    tokenizer: str = option("", help="'' = the model's tokenizer; 'bytes' = byte-level tokenizer (tests)")
    host: str = option("127.0.0.1", help="address the gRPC server binds to")
    port: int = option(50051, help="gRPC port (0 = pick a free one)")
    http_port: int = option(8000, help="port of the OpenAI-compatible HTTP API on the same host as gRPC "
                                       "(0 = off)")
    served_model_name: str = option("", help="the model name the HTTP API serves and expects in "
                                             "requests ('' = the model's own name)")
    frontend_address: str = option("", help="ZMQ address runners connect to "
                                            "('' = ipc://<runtime-dir>/frontend.sock)")
    runtime_dir: str = option("", help="directory for ipc sockets ('' = kvserve.paths.runtime_dir())")
    metrics_port: int = option(9400, help="Prometheus metrics port (0 = off)")
    max_message_bytes: int = option(4 * 1024 * 1024, help="largest gRPC request message accepted")
    max_prompt_tokens: int = option(0, help="longest prompt in tokens (0 = the context length)")
    max_new_tokens_cap: int = option(4096, help="largest max_new_tokens a request may ask for")
    default_max_new_tokens: int = option(128, help="max_new_tokens when a request leaves it unset")
    max_concurrent_streams: int = option(256, help="open Generate streams before RESOURCE_EXHAUSTED")
    max_waiting: int = option(256, help="requests waiting for their first token before "
                                        "RESOURCE_EXHAUSTED")
    max_stop_strings: int = option(16, help="most stop strings per request")
    max_stop_len: int = option(256, help="longest stop string (characters)")
    max_stop_token_ids: int = option(256, help="most stop_token_ids per request")
    max_prompt_chars: int = option(1024 * 1024, help="longest text prompt, chat (roles and contents "
                                                     "together) or Tokenize input, in characters, "
                                                     "checked before tokenizing")
    max_chat_messages: int = option(1024, help="most messages in one chat")
    max_constraint_chars: int = option(256 * 1024, help="longest structured-output constraint (a JSON "
                                                        "schema, regex, grammar or the choices together), "
                                                        "in characters, checked before it is compiled")
    tool_call_parser: str = option("", help="how replies write tool calls: hermes, llama3_json or mistral "
                                            "('' = the one the chat template writes; 'none' = refuse tools)")
    max_send_message_bytes: int = option(16 * 1024 * 1024, help="largest gRPC response message sent "
                                                                "(a long Tokenize answer is the largest)")
    max_concurrent_rpcs: int = option(1024, help="calls of any kind in progress at once before gRPC "
                                                 "answers RESOURCE_EXHAUSTED")
    drain_timeout_s: float = option(10.0, help="seconds to let open streams finish on SIGTERM")
    runner_timeout_s: float = option(1.5, help="seconds of runner silence before it counts as dead")
    request_inactivity_timeout_s: float = option(
        120.0, help="seconds a Generate call may wait for its next output before it fails "
                    "UNAVAILABLE (0 = wait as long as the client's deadline)")
    kv_events_endpoint: str = option("", help="memsvc's KV-event PUB endpoint, reported to routers by GET "
                                              "/kv_event_sources ('' = none)")
    kv_events_replay_endpoint: str = option("", help="memsvc's KV-event replay endpoint, reported by GET "
                                                     "/kv_event_sources")
    kv_event_block_size: int = option(16, help="tokens per block of memsvc's KV events, reported by GET "
                                               "/get_server_info")
    tls_cert: str = option("", help="PEM certificate chain for TLS (with --tls-key)")
    tls_key: str = option("", help="PEM private key for TLS (with --tls-cert)")
    auth_token_file: str = option("", help="file holding the bearer token clients must send "
                                           "(health stays open)")
    allow_remote: bool = option(False, help="allow a tcp:// --frontend-address that is not loopback "
                                            "(runners still need an allowed CURVE key)")
    tls_client_ca: str = option("", help="PEM CA certificate(s): with it, clients must present a "
                                         "certificate this CA signed (mutual TLS; needs --tls-cert)")
    curve_secret_key_file: str = option("", help="the frontend's CURVE secret key (NAME.key_secret from "
                                                 "`kvserve keygen`, mode 0600); with --curve-public-keys-dir, "
                                                 "required for a tcp:// --frontend-address")
    curve_public_keys_dir: str = option("", help="directory of the public keys (*.key) of the runners "
                                                 "allowed to connect over CURVE")

    def __post_init__(self) -> None:
        if self.frontend_address:
            check_address(self.frontend_address, name="frontend_address", allow_remote=self.allow_remote)
        check_port("port", self.port, allow_zero=True)
        check_port("metrics_port", self.metrics_port, allow_zero=True)
        check_port("http_port", self.http_port, allow_zero=True)
        # memsvc binds them (and checks who may connect); here they are only reported
        check_kv_events(self.kv_events_endpoint, self.kv_events_replay_endpoint, self.kv_event_block_size,
                        allow_remote=True)
        if self.http_port and self.http_port in (self.port, self.metrics_port):
            raise ConfigError(f"--http-port {self.http_port}: the gRPC or the metrics port already uses it")
        check_positive(
            self, "max_message_bytes", "max_new_tokens_cap", "default_max_new_tokens",
            "max_concurrent_streams", "max_waiting", "max_stop_strings", "max_stop_len",
            "max_stop_token_ids", "max_prompt_chars", "max_chat_messages", "max_constraint_chars",
            "max_send_message_bytes",
            "max_concurrent_rpcs",
            "drain_timeout_s", "runner_timeout_s",
        )
        if self.tool_call_parser not in ("", "none", *FAMILY_NAMES):
            raise ConfigError(f"--tool-call-parser: {self.tool_call_parser!r} is not one of "
                              f"{', '.join(FAMILY_NAMES)} (or none, or '' for the chat template's)")
        if self.request_inactivity_timeout_s < 0:
            raise ConfigError("--request-inactivity-timeout-s: must be >= 0, got "
                              f"{self.request_inactivity_timeout_s}")
        if self.max_prompt_tokens < 0:
            raise ConfigError(f"--max-prompt-tokens: must be >= 0, got {self.max_prompt_tokens}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key must be given together")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
