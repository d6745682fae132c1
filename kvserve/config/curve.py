"""CURVE for the ZMQ links (runner -> memsvc, runner -> frontend): the key files read and
checked, the keys applied to a socket, and the ZAP handler that admits only listed clients.

Key files are ZeroMQ certificates as `kvserve keygen` (pyzmq's `zmq.auth`) writes them:
``NAME.key`` holds a public key, ``NAME.key_secret`` the public and the secret key. A bad
file raises `ConfigError` naming the flag and the file: missing, not a certificate, a key
that is not 40 Z85 characters, a secret key readable by group or others, a directory of
client keys that others may write to. ipc:// links need no keys (their socket file is
owner-only); a tcp:// link must have them (`require_curve`).

This module knows nothing about what the links carry.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from kvserve.config import ConfigError, flag_name

log = logging.getLogger("kvserve.curve")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # RFC 27: where libzmq asks its ZAP handler
KEYGEN_HINT = "make keys with `kvserve keygen DIR --name NAME`"
_Z85 = set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")
_MAX_DENIED_LOGGED = 64


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """The bind side: its own key pair and the public keys of the clients it admits."""

    public: bytes
    secret: bytes
    allowed: frozenset[bytes]  # Z85 public keys


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """The connect side: its own key pair and the server's public key."""

    public: bytes
    secret: bytes
    server: bytes


def _stat(path: Path, flag: str, what: str) -> os.stat_result:
    try:
        return path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{flag}: {what} {path} does not exist ({KEYGEN_HINT})") from None
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {what} {path}: {exc.strerror}") from None


def _check_key(key: bytes, path: Path, flag: str, which: str) -> bytes:
    text = key.decode("ascii", "replace")
    if len(text) != 40 or not set(text) <= _Z85:
        raise ConfigError(f"{flag}: {path}: the {which} is not 40 Z85 characters ({KEYGEN_HINT})")
    return key


def _read_certificate(path: Path, flag: str, what: str) -> tuple[bytes, bytes | None]:
    st = _stat(path, flag, what)
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{flag}: {what} {path} is not a regular file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except ValueError:
        raise ConfigError(f"{flag}: {path} is not a CURVE key file: no public-key line "
                          f"({KEYGEN_HINT})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag}: cannot read {what} {path}: {exc}") from None
    _check_key(public, path, flag, "public-key")
    if secret is not None:
        _check_key(secret, path, flag, "secret-key")
    return public, secret


def load_secret_key(path: str | os.PathLike, flag: str) -> tuple[bytes, bytes]:
    """(public, secret) from a ``NAME.key_secret`` file that only its owner may read."""
    path = Path(path)
    mode = stat.S_IMODE(_stat(path, flag, "secret key file").st_mode)
    if mode & 0o077:
        raise ConfigError(f"{flag}: secret key file {path} has mode {mode:04o}: group or others may "
                          f"read it; run chmod 600 {path}")
    public, secret = _read_certificate(path, flag, "secret key file")
    if secret is None:
        raise ConfigError(f"{flag}: {path} holds no secret-key (is it the public NAME.key? give "
                          f"NAME.key_secret)")
    if zmq.curve_public(secret) != public:
        raise ConfigError(f"{flag}: {path}: its public-key is not the one of its secret-key")
    return public, secret


def load_public_key(path: str | os.PathLike, flag: str) -> bytes:
    """The public key of a ``NAME.key`` file."""
    path = Path(path)
    return _read_certificate(path, flag, "public key file")[0]


def load_public_keys(directory: str | os.PathLike, flag: str) -> frozenset[bytes]:
    """The public keys of every ``*.key`` file in `directory` (a directory no one but its
    owner may write to: whoever can add a file there is admitted)."""
    directory = Path(directory)
    st = _stat(directory, flag, "key directory")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{flag}: {directory} is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise ConfigError(f"{flag}: key directory {directory} has mode {mode:04o}: group or others may "
                          f"add keys to it; run chmod go-w {directory}")
    keys = set()
    for path in sorted(directory.glob("*.key")):
        if stat.S_IMODE(_stat(path, flag, "public key file").st_mode) & 0o022:
            raise ConfigError(f"{flag}: public key file {path} is writable by group or others; "
                              f"run chmod go-w {path}")
        keys.add(_read_certificate(path, flag, "public key file")[0])
    if not keys:
        raise ConfigError(f"{flag}: {directory} holds no *.key public key file: no client could "
                          f"connect ({KEYGEN_HINT}, then copy NAME.key there)")
    return frozenset(keys)


def _is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def require_curve(address: str, address_field: str, *key_fields: tuple[str, str]) -> bool:
    """True when the link at `address` uses CURVE: all of `key_fields` ((field, value) pairs)
    are given. Some but not all given, or a tcp:// address without them: ConfigError."""
    given = [name for name, value in key_fields if value]
    flags = " and ".join(flag_name(name) for name, _ in key_fields)
    if given and len(given) != len(key_fields):
        raise ConfigError(f"{flags} go together (only {flag_name(given[0])} is given)")
    if not given and _is_tcp(address):
        raise ConfigError(f"{flag_name(address_field)}: a tcp:// address needs CURVE: give {flags} "
                          f"({KEYGEN_HINT}), or use an ipc:// address")
    return bool(given)


def server_keys(secret_key_file: str, public_keys_dir: str, *, secret_field: str,
                dir_field: str) -> ServerKeys:
    """Load and check the bind side's keys."""
    public, secret = load_secret_key(secret_key_file, flag_name(secret_field))
    return ServerKeys(public=public, secret=secret,
                      allowed=load_public_keys(public_keys_dir, flag_name(dir_field)))


def client_keys(secret_key_file: str, server_public_key_file: str, *, secret_field: str,
                server_field: str) -> ClientKeys:
    """Load and check the connect side's keys."""
    public, secret = load_secret_key(secret_key_file, flag_name(secret_field))
    return ClientKeys(public=public, secret=secret,
                      server=load_public_key(server_public_key_file, flag_name(server_field)))


def apply_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make `sock` (before connect) a CURVE client that only talks to the server's key."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server


class ZapHandler:
    """Answers libzmq's ZAP requests (RFC 27) for one context: a CURVE client whose public
    key is in `allowed` gets 200, anyone else 400 (libzmq then drops the connection).

    `start` binds the handler's socket before it returns, so no connection is ever accepted
    without it. The thread ends when the context is terminated."""

    def __init__(self, ctx: zmq.Context, allowed: frozenset[bytes], *, name: str) -> None:
        self._allowed = {z85.decode(k) for k in allowed}
        self._name = name
        self._sock = ctx.socket(zmq.REP, socket_class=zmq.Socket)
        self._sock.linger = 0
        self._sock.bind(ZAP_ENDPOINT)
        self._denied: set[bytes] = set()
        self._thread = threading.Thread(target=self._loop, name=f"zap-{name}", daemon=True)

    def start(self) -> ZapHandler:
        self._thread.start()
        return self

    def decide(self, frames: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request."""
        version, request_id = frames[0], frames[1] if len(frames) > 1 else b""
        if version != b"1.0" or len(frames) < 6:
            return [b"1.0", request_id, b"500", b"bad ZAP request", b"", b""]
        mechanism, credentials = frames[5], frames[6:]
        key = credentials[0] if mechanism == b"CURVE" and credentials else b""
        if key in self._allowed:
            return [version, request_id, b"200", b"OK", z85.encode(key), b""]
        if len(self._denied) < _MAX_DENIED_LOGGED and key not in self._denied:
            self._denied.add(key)
            who = z85.encode(key).decode() if len(key) == 32 else mechanism.decode(errors="replace")
            log.warning("%s: refused a client from %s: key %s is not allowed", self._name,
                        frames[3].decode(errors="replace") or "?", who)
        return [version, request_id, b"400", b"key not allowed", b"", b""]

    def _loop(self) -> None:
        try:
            while True:
                self._sock.send_multipart(self.decide(self._sock.recv_multipart()))
        except zmq.ContextTerminated:
            pass
        finally:
            self._sock.close(0)


def apply_server(sock: zmq.Socket, ctx: zmq.Context, keys: ServerKeys, *, name: str) -> ZapHandler:
    """Make `sock` (before bind) a CURVE server that admits only `keys.allowed`; starts the
    context's ZAP handler. Call once per context."""
    handler = ZapHandler(ctx, keys.allowed, name=name).start()
    secure_server(sock, keys, name=name)
    return handler


def secure_server(sock: zmq.Socket, keys: ServerKeys, *, name: str) -> None:
    """Make one more `sock` of a context that `apply_server` set up (before bind) a CURVE
    server under the same ZAP handler (`name`)."""
    sock.curve_server = True
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.zap_domain = name.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler answering: no connection
