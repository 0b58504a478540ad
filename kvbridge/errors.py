"""The one error tree of kvbridge.

Every error kvbridge raises on purpose is a :class:`KVBridgeError`. Backends translate their
native errors into these classes at their boundary (the way httpx maps socket errors), so callers
catch one tree whatever the transport.
"""

from __future__ import annotations

__all__ = [
    "KVBridgeError",
    "ConfigError",
    "ParamsError",
    "ReplayError",
    "RemoteError",
    "BackendNotFound",
    "BackendUnavailable",
    "LayoutError",
    "LayoutMismatch",
    "DescriptorError",
    "MessageError",
    "MessageTooLarge",
    "AuthError",
    "TransportError",
    "PeerError",
    "UnknownPeer",
    "PeerUnreachable",
    "PeerForged",
    "TransferFailed",
    "TransferTimeout",
    "TransportClosed",
    "LeaseExpired",
    "PipeClosed",
]


class KVBridgeError(Exception):
    """Root of every error kvbridge raises on purpose."""


class ConfigError(KVBridgeError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class ParamsError(KVBridgeError, ValueError):
    """A request's ``kv_transfer_params`` are malformed; :attr:`field` names the offending key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class BackendNotFound(ConfigError):
    """No backend of that name is installed (the message lists the installed ones)."""


class BackendUnavailable(KVBridgeError, ImportError):
    """The backend is installed but cannot load: a missing package or system library."""


class LayoutError(KVBridgeError, ValueError):
    """A KV-cache layout or a list of block ids is not usable."""


class LayoutMismatch(LayoutError):
    """Two engines' layouts (or model, dtype, block size…) are incompatible; names the field."""


class DescriptorError(KVBridgeError, ValueError):
    """Descriptor lists are malformed: unequal length, unequal sizes, outside registered memory."""


class MessageError(KVBridgeError, ValueError):
    """A control message or metadata blob could not be decoded or is of the wrong kind."""


class MessageTooLarge(MessageError):
    """A message exceeds the configured size limit."""


class AuthError(MessageError):
    """A control message failed authentication against the shared secret."""


class ReplayError(AuthError):
    """An authenticated control message was seen before or is outside the replay window."""


class RemoteError(KVBridgeError):
    """A peer refused a request; :attr:`kind` says why in a word the caller can branch on."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}" if message else kind)
        self.kind = kind
        self.message = message


class TransportError(KVBridgeError):
    """A transport operation failed."""


class PeerError(TransportError):
    """Something is wrong with a remote peer."""


class UnknownPeer(PeerError, KeyError):
    """The peer was never added (or was removed)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else "unknown peer"


class PeerUnreachable(PeerError):
    """The peer did not answer in time or its process is gone."""


class PeerForged(PeerError):
    """A peer's claimed identity is not proven: its handshake answer names another address, its
    data plane did not show this handshake's proof (relayed, replayed or stale metadata), or its
    transport is another engine, generation or rank than it claims."""


class TransferFailed(TransportError):
    """A posted READ/WRITE ended in failure. No byte of it may be trusted."""


class TransferTimeout(TransferFailed):
    """A transfer did not finish in time. A timeout is a failure, never a success."""


class TransportClosed(TransportError):
    """The transport was closed; no new operation is accepted."""


class LeaseExpired(KVBridgeError):
    """The lease of a transfer ended before the matching side arrived."""


class PipeClosed(KVBridgeError):
    """The pipe was closed, or the other half reached end-of-stream."""
