"""Authenticated internal planes: who may talk to whom inside the stack.

One directory of keys (`--internal-keys DIR`; `loraserve up` makes one in its data directory,
`loraserve keys internal --out DIR` makes one for a multi-machine deployment) holds a CURVE key
pair per role and the internal gRPC token:

    gateway.key  gateway.key_secret      scheduler.key  scheduler.key_secret
    store.key    store.key_secret        worker.key     worker.key_secret
    internal-grpc.token

Every role reads every `*.key` (public keys) and its own `*.key_secret`; only the gateway, the
scheduler and the store read the token. A machine running one role needs only the public keys, its
own secret and (gateway, scheduler, store) the token: a worker's machine never holds the token.

ZMQ (pyzmq's CURVE + a ZAP handler, `zmq.auth`): each bound socket is a CURVE server that admits only
the roles listed in `CLIENTS_OF` — workers on the scheduler's worker port and the store's data port;
workers and the scheduler on a gateway's token sink. A client must know the server's public key, so
a token sink an attacker named in `reply_to` cannot complete the handshake without the gateway's
secret key: tokens only ever reach a real gateway. ZAP domains are enforced, so a server socket
whose handler is missing refuses every peer instead of admitting any.

gRPC (`loraserve/grpc_token.py`): the scheduler's and the store's ports require the token as
`authorization: Bearer ...`, except health and reflection.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from loraserve.config_cli import setting
from loraserve.endpoints import is_loopback
from loraserve.errors import InvalidConfigError

log = logging.getLogger(__name__)

ROLES = ("gateway", "scheduler", "store", "worker")
# The roles allowed to connect to each role's bound ZMQ socket.
CLIENTS_OF = {"scheduler": ("worker",), "gateway": ("worker", "scheduler"), "store": ("worker",)}
TOKEN_ROLES = ("gateway", "scheduler", "store")
TOKEN_FILE = "internal-grpc.token"


def generate(directory: str | os.PathLike) -> Path:
    """Make every missing key pair and the token in `directory` (secrets readable by the owner only);
    keys already there are kept, so a restarted stack keeps its keys."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    for role in ROLES:
        if not (path / f"{role}.key_secret").exists():
            _, secret = zmq.auth.create_certificates(path, role)
            os.chmod(secret, 0o600)
    token = path / TOKEN_FILE
    if not token.exists():
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return path


@dataclass(frozen=True)
class Curve:
    """CURVE options of one socket: a server (`domain` set) or a client of `server_key`."""

    public: bytes
    secret: bytes
    server_key: bytes | None = None
    domain: str = ""

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_publickey, sock.curve_secretkey = self.public, self.secret
        if self.server_key is None:
            sock.curve_server = True
            sock.zap_domain = self.domain.encode()
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        else:
            sock.curve_serverkey = self.server_key


@dataclass(frozen=True)
class InternalKeys:
    """What one role holds: every role's public key, its own secret key, the token if it needs it."""

    role: str
    public: dict[str, bytes]
    secret: bytes
    token: str | None = None

    def server(self) -> Curve:
        """Options for this role's bound socket."""
        return Curve(self.public[self.role], self.secret, domain=f"loraserve.{self.role}")

    def client_of(self, server_role: str) -> Curve:
        """Options for a socket connecting to a `server_role`'s bound socket."""
        return Curve(self.public[self.role], self.secret, server_key=self.public[server_role])

    def authenticator(self, ctx: zmq.Context) -> ThreadAuthenticator:
        """Start the ZAP handler of `ctx` (before its server socket binds): admits the CURVE keys of
        the roles in CLIENTS_OF[role], refuses every other peer. Stop it when the socket closes."""
        allowed = {self.public[role] for role in CLIENTS_OF[self.role]}
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback(f"loraserve.{self.role}", _AllowKeys(frozenset(allowed)))
        return auth


class _AllowKeys:
    """pyzmq credentials provider: a fixed set of z85 public keys."""

    def __init__(self, keys: frozenset[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def load(directory: str | os.PathLike, role: str) -> InternalKeys:
    """The keys `role` needs from `directory`; InvalidConfigError naming what is missing or wrong."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    path = Path(directory)
    if not path.is_dir():
        raise InvalidConfigError(f"--internal-keys {path}: not a directory (make one with 'loraserve keys internal')")
    public = {}
    for name in ROLES:
        public[name] = _read_key(path / f"{name}.key", "public")[0]
    own_public, secret = _read_key(path / f"{role}.key_secret", "secret")
    if secret is None or own_public != public[role]:
        raise InvalidConfigError(f"--internal-keys {path}: {role}.key_secret does not match {role}.key")
    token = None
    if role in TOKEN_ROLES:
        try:
            token = (path / TOKEN_FILE).read_text().strip()
        except OSError as e:
            raise InvalidConfigError(f"--internal-keys {path}: cannot read {TOKEN_FILE}: {e.strerror}") from None
        if len(token) < 32:
            raise InvalidConfigError(f"--internal-keys {path}: {TOKEN_FILE} must hold at least 32 characters")
    return InternalKeys(role, public, secret, token)


def _read_key(file: Path, kind: str) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(file)
    except (OSError, ValueError) as e:
        raise InvalidConfigError(f"--internal-keys: cannot read the {kind} key {file}: {e}") from None


def load_optional(directory: str | os.PathLike | None, role: str) -> InternalKeys | None:
    """`load` when a directory is given; None (unauthenticated planes, loopback only) otherwise."""
    return None if directory is None else load(directory, role)


@dataclass(frozen=True)
class InternalAuthSettings:
    """Every role's internal keys (`--internal-keys`) and the flag to run without them beyond loopback."""

    internal_keys: str | None = setting(
        None,
        "directory of the stack's internal keys (CURVE key pairs, internal gRPC token): only the stack's "
        "own roles may then use the internal ports. Without it the internal planes are unauthenticated "
        "(keep them on loopback). 'loraserve up' makes one; 'loraserve keys internal' makes one to copy",
        metavar="DIR",
    )
    insecure_no_internal_auth: bool = setting(
        False,
        "serve internal ports beyond loopback without --internal-keys (anyone who reaches them could act "
        "as any role): only where something else guards the network",
    )


def check_open_planes(role: str, keys: InternalKeys | None, binds: list[str], insecure: bool) -> None:
    """Without internal keys a role's internal ports are open to whoever reaches them: refuse to
    start (InvalidConfigError) when one of `binds` reaches beyond loopback, unless `insecure`; say so
    in a WARNING in every case."""
    if keys is not None:
        return
    public = [bind for bind in binds if not is_loopback(bind)]
    if public and not insecure:
        raise InvalidConfigError(
            f"refusing to serve the {role}'s internal ports {', '.join(public)} without authentication: anyone "
            "who reaches them could register a fake worker, read prompts, submit requests or fetch and delete "
            "adapters. Give --internal-keys DIR (made by 'loraserve keys internal'), bind 127.0.0.1, or pass "
            "--insecure-no-internal-auth (env LORASERVE_INSECURE_NO_INTERNAL_AUTH=1) if something else guards "
            "this network"
        )
    where = ", ".join(binds) if binds else "its connections to the other roles"
    log.warning(
        "%s: no --internal-keys: %s are unauthenticated; every local user (or, beyond loopback, every host "
        "that reaches them) can act as any role",
        role,
        where,
    )
