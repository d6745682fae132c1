"""`kvserve generate`: stream a completion from a running kvserve to stdout.

A thin gRPC client of `kvserve.v1.Generator`: builds a `GenerateRequest` from flags
(plain text or `--chat`, sampling parameters) and prints text deltas as they arrive;
`--verbose` adds the finish reason and usage on stderr. Knows only the public API.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc

from kvserve.v1 import generator_pb2 as pb
from kvserve.v1 import generator_pb2_grpc as pb_grpc


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve generate", description=__doc__.split("\n\n")[0])
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument("--address", default="127.0.0.1:50051", help="host:port of the frontend (default: %(default)s)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message rendered with the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=None, help="most tokens to generate (server default 128)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling in (0, 1]")
    p.add_argument("--top-k", type=int, default=None, help="top-k sampling (0 = off)")
    p.add_argument("--min-p", type=float, default=None, help="min-p sampling in [0, 1]")
    p.add_argument("--repetition-penalty", type=float, default=None, help="> 0, 1 = off")
    p.add_argument("--presence-penalty", type=float, default=None, help="presence penalty")
    p.add_argument("--frequency-penalty", type=float, default=None, help="frequency penalty")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds (default: %(default)s)")
    p.add_argument("--token-file", default=None, help="file with a bearer token to send")
    p.add_argument("--tls-ca", default=None, help="PEM CA certificate: connect with TLS")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate for mutual TLS (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--verbose", "-v", action="store_true", help="print finish reason and usage to stderr")
    return p


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    """The GenerateRequest the flags describe (unset flags stay unset: server defaults)."""
    sampling = pb.SamplingParams(stop=args.stop, ignore_eos=args.ignore_eos)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "max_new_tokens"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    if args.chat:
        messages = [pb.ChatMessage(role="system", content=args.system)] if args.system else []
        messages.append(pb.ChatMessage(role="user", content=args.prompt))
        return pb.GenerateRequest(chat=pb.Chat(messages=messages), sampling=sampling)
    return pb.GenerateRequest(text=args.prompt, sampling=sampling)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvserve generate`; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.system and not args.chat:
        print("kvserve generate: --system needs --chat", file=sys.stderr)
        return 2
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_cert and not args.tls_ca):
        print("kvserve generate: --tls-cert and --tls-key go together, with --tls-ca", file=sys.stderr)
        return 2
    metadata = []
    if args.token_file:
        metadata.append(("authorization", f"Bearer {Path(args.token_file).read_text().strip()}"))
    if args.tls_ca:
        key, cert = (Path(p).read_bytes() if p else None for p in (args.tls_key, args.tls_cert))
        creds = grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes(), key, cert)
        channel = grpc.secure_channel(args.address, creds)
    else:
        channel = grpc.insecure_channel(args.address)
    last = None
    try:
        with channel:
            stub = pb_grpc.GeneratorStub(channel)
            for msg in stub.Generate(build_request(args), timeout=args.timeout, metadata=metadata):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                last = msg
    except grpc.RpcError as exc:
        print(f"\nkvserve generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    sys.stdout.write("\n")
    if args.verbose and last is not None:
        u = last.usage
        print(f"[finish_reason={last.finish_reason} prompt_tokens={u.prompt_tokens} "
              f"cached_tokens={u.cached_tokens} completion_tokens={u.completion_tokens}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
