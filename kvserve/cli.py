"""`kvserve` command line: one subcommand per role, each implemented by its own module.

Each subcommand module exposes ``main(argv: list[str]) -> int``; this file only routes.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvserve.serve.main", "run memsvc, runners and the gRPC frontend together"),
    "memsvc": ("kvserve.memsvc.server", "run the memory service (KV pool owner)"),
    "runner": ("kvserve.runner.main", "run one runner worker (model + scheduler)"),
    "frontend": ("kvserve.frontend.main", "run the gRPC frontend"),
    "generate": ("kvserve.tools.generate", "stream a completion from a running kvserve"),
    "fetch-model": ("kvserve.tools.fetch_model", "download the embedded default model into the cache"),
    "bench": ("kvserve.tools.bench", "load generator against a running kvserve"),
    "keygen": ("kvserve.tools.keygen", "make a CURVE key pair for the memsvc and runner links"),
}


def _usage() -> str:
    lines = ["usage: kvserve COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<12} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "`kvserve COMMAND --help` explains each command's flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from kvserve import __version__

        print(f"kvserve {__version__}")
        return 0
    entry = COMMANDS.get(argv[0])
    if entry is None:
        print(f"kvserve: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(entry[0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
