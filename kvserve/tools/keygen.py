"""`kvserve keygen DIR [--name NAME]`: make a CURVE key pair for the ZMQ links.

Writes ``DIR/NAME.key`` (the public key, mode 0644: give it to the other side) and
``DIR/NAME.key_secret`` (public and secret key, mode 0600 from the start: it never exists
readable by others, even for an instant). pyzmq's `zmq.auth.create_certificates` writes
the files; existing keys are never overwritten unless ``--force``. The processes read them
with kvserve.config.curve (docs/deploy.md, "Who may connect").
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import zmq.auth

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve keygen", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="directory for the key files (created 0700 if missing)")
    parser.add_argument("--name", default="kvserve",
                        help="base name: NAME.key (public) and NAME.key_secret (secret) (default: kvserve)")
    parser.add_argument("--force", action="store_true", help="overwrite existing key files of that name")
    return parser


def keygen(directory: Path, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write NAME.key (0644) and NAME.key_secret (0600) into `directory`; returns their paths.
    ValueError for a bad name or existing files (without `force`)."""
    if not name or name in (".", "..") or "/" in name or "\0" in name or not name.isprintable():
        raise ValueError(f"--name: {name!r} must be a plain file name")
    public, secret = directory / f"{name}{PUBLIC_SUFFIX}", directory / f"{name}{SECRET_SUFFIX}"
    existing = [str(p) for p in (public, secret) if p.exists()]
    if existing and not force:
        raise ValueError(f"{' and '.join(existing)} already exist (--force replaces them)")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory")
    for p in (public, secret):
        p.unlink(missing_ok=True)  # a new file gets the umask below, an old one would keep its mode
    old = os.umask(0o077)
    try:
        zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    return public, secret


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvserve keygen`."""
    args = build_parser().parse_args(argv)
    try:
        public, secret = keygen(Path(args.dir), args.name, force=args.force)
    except ValueError as exc:
        print(f"kvserve keygen: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvserve keygen: error: {args.dir}: {exc}", file=sys.stderr)
        return 1
    print(f"public key: {public}\nsecret key: {secret} (mode 0600: keep it on this host)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
