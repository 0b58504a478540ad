"""Which secret authenticates an engine's control and data planes, and where it came from.

Every engine authenticates its control messages, notifications and shm handshakes with an
HMAC key (:class:`~kvbridge.messages.Codec`). :func:`resolve` picks it, highest first:

1. ``secret`` (``KVBRIDGE_SECRET`` or ``kv_connector_extra_config``): the fleet's shared secret.
   A control channel on a routable address needs one (engines on other hosts must agree on it).
2. ``allow_insecure_control`` without a secret: no authentication at all — anyone who reaches
   the control address can steer transfers. Only for a network you trust entirely.
3. Otherwise the **per-user secret** of this host, created on first use: 32 random bytes (hex)
   in the file ``secret_file`` (``KVBRIDGE_SECRET_FILE``), by default
   ``$XDG_RUNTIME_DIR/kvbridge/secret``, else ``~/.local/state/kvbridge/secret``, else
   ``/tmp/kvbridge-<uid>/secret``. The file is mode 0600 in a directory that must be this
   user's and private, below directories only root or this user may change
   (:func:`kvbridge.host.files.check_path`); anything else is refused with an error naming
   the path. Every engine, ``kvbridge stats``, the proxy, the benches and the demo of one user
   on one host find the same file, so a loopback deployment is authenticated with no set-up;
   a process of another user — or of this user in another container that does not share the
   file — cannot talk to it.

Two processes that create the file at once agree on one content (the second links nothing and
reads the first's). Deleting the file while engines run makes newly started ones use a new
secret; restart them together (docs/security.md).

Nothing here logs or returns the secret's value except :attr:`Trust.secret`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvbridge.config import Config
from kvbridge.control import is_loopback
from kvbridge.errors import ConfigError
from kvbridge.host import files

__all__ = ["Trust", "resolve", "default_secret_file", "user_secret", "for_tools", "admin_token"]

_NAME_BYTES = 32
_MAX_FILE_BYTES = 4096
_MIN_SECRET_BYTES = 16


@dataclass(frozen=True)
class Trust:
    """The effective secret (None: unauthenticated) and a description of where it came from
    that is safe to log (never the value)."""

    secret: bytes | None
    source: str
    path: Path | None = None
    created: bool = False

    @property
    def authenticated(self) -> bool:
        return self.secret is not None

    def describe(self) -> str:
        if self.secret is None:
            return f"unauthenticated ({self.source})"
        return f"authenticated with the {self.source}"


def default_secret_file(env: Mapping[str, str] | None = None) -> Path:
    """Where the per-user secret lives when ``secret_file`` is not set (module docstring)."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir() and _usable(Path(runtime)):
        return Path(runtime) / "kvbridge" / "secret"
    state = env.get("XDG_STATE_HOME") or (
        str(Path(env["HOME"]) / ".local" / "state") if env.get("HOME") else "")
    if state and _usable(Path(state).parent if not Path(state).exists() else Path(state)):
        return Path(state) / "kvbridge" / "secret"
    return Path("/tmp") / f"kvbridge-{os.geteuid()}" / "secret"


def _usable(path: Path) -> bool:
    """A directory this user may create things in (the nearest existing ancestor decides)."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return False
        probe = probe.parent
    return probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)


def user_secret(path: Path) -> tuple[bytes, bool]:
    """The per-user secret in ``path`` (created if missing); ``(secret, created)``.

    Raises :class:`~kvbridge.host.files.UnsafePath` naming the path when its directory (or
    one above it) is not safe, the file is a link, not a regular file or not this user's, and
    :class:`ConfigError` when it holds fewer than 16 bytes or is open to group or others."""
    dir_fd = files.private_dir(path.parent)
    try:
        created = files.write_atomic(dir_fd, path.name, os.urandom(_NAME_BYTES).hex().encode()
                                     + b"\n", exclusive=True)
        try:
            fd, st = files.open_regular(dir_fd, path.name)
        except files.UnsafePath as exc:
            raise files.UnsafePath(f"{path}: {exc}") from None
        try:
            if st.st_mode & 0o077:
                raise ConfigError(f"{path} is mode 0o{st.st_mode & 0o777:o}: the secret file "
                                  "must be readable by its owner only (chmod 600)")
            if st.st_size > _MAX_FILE_BYTES:
                raise ConfigError(f"{path} is {st.st_size} bytes; a secret file holds at most "
                                  f"{_MAX_FILE_BYTES}")
            try:
                data = files.read_exactly(fd, st.st_size).strip()
            except ValueError as exc:  # it changed while read
                raise ConfigError(f"{path}: {exc}") from None
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    if len(data) < _MIN_SECRET_BYTES:
        raise ConfigError(f"{path} holds {len(data)} bytes; a secret needs at least "
                          f"{_MIN_SECRET_BYTES} (delete it to have a new one made)")
    return data, created


def resolve(config: Config, env: Mapping[str, str] | None = None) -> Trust:
    """The secret ``config`` asks for (see the module docstring). Raises :class:`ConfigError`
    for a routable control address (bound or advertised) without a fleet secret (unless
    insecure is allowed) and for a per-user secret file that is unsafe or unusable, naming the
    path."""
    if config.secret:
        where = config.sources.get("secret", "configuration")
        return Trust(config.secret.encode(), f"fleet secret ({where})")
    if config.allow_insecure_control:
        return Trust(None, "allow_insecure_control is set and no secret")
    hosts = [("the control channel binds {!r}, a", config.side_channel_host)]
    if config.advertise_host:
        hosts.append(("advertise_host {!r} is a", config.advertise_host))
    for what, host in hosts:
        if not is_loopback(host):
            raise ConfigError(
                what.format(host) + " routable address, and no fleet secret is set: engines on "
                "other hosts cannot share this host's per-user secret. Set KVBRIDGE_SECRET "
                "(same on every engine) or, on a trusted network, "
                "KVBRIDGE_ALLOW_INSECURE_CONTROL=1")
    path = Path(config.secret_file).expanduser() if config.secret_file else \
        default_secret_file(env)
    secret, created = user_secret(path)
    return Trust(secret, f"per-user secret {path}" + (" (created)" if created else ""),
                 path, created)


def for_tools(secret: str | None = None, env: Mapping[str, str] | None = None) -> Trust:
    """The secret a tool (``kvbridge stats``, the proxy, a bench) talks to local engines with:
    ``secret`` if given, else what an engine configured by ``env`` would use."""
    env = os.environ if env is None else env
    if secret:
        return Trust(secret.encode(), "fleet secret (command line)")
    config = Config.load({}, {k: v for k, v in env.items()
                              if k in ("KVBRIDGE_SECRET", "KVBRIDGE_SECRET_FILE",
                                       "KVBRIDGE_ALLOW_INSECURE_CONTROL")})
    return resolve(config, env)


def admin_token(secret: bytes) -> str:
    """The bearer token of a proxy's ``/admin`` endpoints, derived from the fleet secret (or the
    per-user one) so that whoever may talk to the engines may run the fleet, and the secret
    itself never travels: HMAC-SHA256 of a fixed label, hex."""
    return hmac.new(secret, b"kvbridge proxy admin v1", hashlib.sha256).hexdigest()
