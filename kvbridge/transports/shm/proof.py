"""The dialler's side of the shm handshake: connect, prove who listens, fetch the registration.

:meth:`Dialler.prove` connects to the abstract Unix socket a peer's metadata names, lets the
kernel say who listens (``SO_PEERCRED``) and refuses another user or a pid other than the
claimed one, takes a pidfd of that process, shows it the proof of this handshake and asks for
its current registration (and its memfds), checks the answer against the socket and the
metadata, maps the shared memory it sent (validated, :class:`~.memfd.PeerMapping`) and opens the
notification sender: a :class:`_Peer` whose pid and regions every transfer then uses.

Thread-safety and blocking: :class:`Dialler` holds only settings, so calls from several threads
are independent. :meth:`Dialler.prove` blocks for one local round trip, at most ``timeout``
seconds, plus validating and mapping the peer's memfds (a read of ``/proc/<pid>/maps``).
:class:`_Peer` is shared by the transport's threads: ``retire`` runs once, on the worker (behind
every transfer queued for the peer) or at ``close``.
"""

from __future__ import annotations

import array
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import msgspec

from kvbridge.errors import MessageError, PeerForged, PeerUnreachable
from kvbridge.messages import Codec, PipeFrame
from kvbridge.transports.notify import NotificationSender
from kvbridge.transports.shm import rangecopy
from kvbridge.transports.shm.cma import _alive, _close_fd, _peer_pidfd, _peercred, _poller
from kvbridge.transports.shm.listener import _Listener
from kvbridge.transports.shm.memfd import (
    MAX_FDS,
    FdRefused,
    FdUnverifiable,
    PeerMapping,
    Piece,
    close_all,
)
from kvbridge.transports.shm.wire import (
    _MAX_REPLY_BYTES,
    ShmMetadata,
    _encoder,
    _Query,
    _Refused,
    _reg_decoder,
    _Registration,
)

log = logging.getLogger("kvbridge.transport.shm")


@dataclass(eq=False)
class _Peer:
    """A peer as proven by the handshake: the pid and regions every transfer uses."""

    agent: str
    pid: int
    pidfd: int
    version: int
    regions: list[tuple[int, int]]
    sender: NotificationSender
    mapping: PeerMapping | None = None
    #: the native range copy that copies through ``mapping`` (None without a mapping)
    copy: rangecopy.RangeCopy | None = None
    retired: bool = False
    #: the listener's watch of the pidfd (None: not watched)
    watch: tuple[_Listener, int] | None = None

    def __post_init__(self) -> None:
        self._poller = _poller(self.pidfd)

    def alive(self) -> bool:
        """False once the proven process exited (its pid may then belong to another one)."""
        return self._poller is None or not self._poller.poll(0)

    def retire(self, unmap: bool = True) -> None:
        """Close the sender, the pidfd and (with ``unmap``) the mapping of its shared memory
        (on the worker, after every job queued before: no copy uses the mapping then)."""
        self.retired = True
        if self.watch is not None:
            listener, key = self.watch
            self.watch = None
            listener.unwatch(key)
        if unmap and self.mapping is not None:
            self.mapping.close()
        self.sender.close()
        if self.pidfd >= 0:
            self._poller = None
            os.close(self.pidfd)
            self.pidfd = -1


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        view = view[sock.send(view):]


def _recv_exact(sock: socket.socket, n: int, deadline: float,
                fds: list[int] | None = None) -> bytes:
    """``n`` bytes; with ``fds``, also the fds that come with them, appended there (closed
    on exec; more than :data:`MAX_FDS` in all raises :class:`MessageError`: the caller closes
    ``fds`` in any case)."""
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        if fds is None:
            chunk = sock.recv(min(n - len(buf), 1 << 16))
        else:
            chunk, anc, flags, _ = sock.recvmsg(min(n - len(buf), 1 << 16),
                                                socket.CMSG_SPACE(4 * MAX_FDS),
                                                socket.MSG_CMSG_CLOEXEC)
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(data[:len(data) - len(data) % got.itemsize])
                    fds.extend(got)
            # the kernel closes what did not fit and says so with MSG_CTRUNC
            if len(fds) > MAX_FDS or flags & socket.MSG_CTRUNC:
                raise MessageError(f"more than {MAX_FDS} fds sent with the answer")
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


@contextmanager
def _on_the_socket(who: str, timeout: float) -> Iterator[None]:
    """What the socket exchange raises, as :class:`PeerUnreachable` naming ``who``."""
    try:
        yield
    except PeerUnreachable:
        raise
    except TimeoutError as exc:
        raise PeerUnreachable(
            f"{who} did not answer on its shm socket within {timeout} s"
        ) from exc
    except (MessageError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PeerUnreachable(f"{who} answered a malformed registration: {exc}") from None
    except ConnectionError as exc:
        raise PeerUnreachable(
            f"{who} closed its shm socket without answering ({exc}): does it use another "
            "shared secret, or is its listener busy?"
        ) from exc
    except OSError as exc:
        raise PeerUnreachable(f"{who}'s shm socket failed during the handshake: {exc}") from exc


class Dialler:
    """Proves peers for the transport ``agent_name``: ``hs_codec`` frames the handshake,
    ``codec`` the notifications sent to the peer; ``map_peers`` asks for (and maps) the peer's
    shared memory. See the module docstring."""

    def __init__(self, agent_name: str, codec: Codec, hs_codec: Codec, timeout: float,
                 map_peers: bool) -> None:
        self.agent_name = agent_name
        self.codec, self.hs_codec = codec, hs_codec
        self.timeout, self.map_peers = timeout, map_peers

    def prove(self, meta: ShmMetadata, proof: bytes) -> _Peer:
        """Connect to the peer's socket, prove its pid and uid, fetch its registration.

        Raises :class:`PeerForged` (the process behind the socket did not let us in with
        ``proof``) or :class:`PeerUnreachable` (nothing listening, another user, a claim the
        socket disproves, a malformed or refused answer, shared memory that is refused).
        """
        who = f"peer {meta.agent!r}"
        deadline = time.monotonic() + self.timeout
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []
        pidfd = -1
        try:
            with _on_the_socket(who, self.timeout):
                pid = self._connect(meta, who, sock)
                try:
                    pidfd = _peer_pidfd(sock, pid)
                except ProcessLookupError:
                    raise PeerUnreachable(f"{who}: process {pid} is gone") from None
                answer = self._ask(proof, who, sock, deadline, fds)
            reg = _check(answer, meta, proof, pid, pidfd, who)
            mapping = self._map(reg, fds, pid, who)
            try:
                sender = NotificationSender(reg.notify_address, self.agent_name, self.codec)
            except Exception as exc:  # noqa: BLE001 - zmq refuses an unusable address
                if mapping is not None:
                    mapping.close()
                raise PeerUnreachable(
                    f"{who} answered an unusable notification address "
                    f"{reg.notify_address!r}: {exc}"
                ) from None
            copy = rangecopy.load() if mapping is not None else None
            return _Peer(reg.agent, pid, pidfd, reg.version, list(reg.regions), sender,
                         mapping, copy)
        except BaseException:
            _close_fd(pidfd)
            raise
        finally:
            sock.close()
            close_all(fds)  # mapped or refused: the mappings keep what they need

    def _connect(self, meta: ShmMetadata, who: str, sock: socket.socket) -> int:
        """Connect to the claimed socket; the pid the kernel says listens there."""
        sock.settimeout(self.timeout)
        try:
            sock.connect(meta.socket)
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            raise PeerUnreachable(
                f"{who} (pid {meta.pid}) is gone: nothing listens on its shm socket "
                "(or it runs in another network namespace)"
            ) from exc
        pid, uid, _ = _peercred(sock)
        if uid != os.geteuid():
            raise PeerUnreachable(
                f"{who}'s shm socket belongs to uid {uid}, not to this process's uid "
                f"{os.geteuid()}: the shm transport only connects processes of one user"
            )
        if pid <= 0:
            raise PeerUnreachable(
                f"the process behind {who}'s shm socket is not visible in this PID namespace"
            )
        if pid != meta.pid:
            raise PeerUnreachable(
                f"{who}'s metadata claims pid {meta.pid}, but the process listening on its "
                f"shm socket is pid {pid}: refusing forged or stale metadata"
            )
        return pid

    def _ask(self, proof: bytes, who: str, sock: socket.socket, deadline: float,
             fds: list[int]) -> _Registration | _Refused:
        """Send the query with ``proof``; the decoded answer (its fds appended to ``fds``)."""
        request = self.hs_codec.encode(
            PipeFrame(seq=0, payload=_encoder.encode(_Query(proof=proof, fds=self.map_peers)))
        )
        _send_all(sock, len(request).to_bytes(4, "big") + request, deadline)
        size = int.from_bytes(_recv_exact(sock, 4, deadline, fds), "big")
        if not 0 < size <= _MAX_REPLY_BYTES:
            raise PeerUnreachable(
                f"{who} announced a registration of {size} bytes (limit {_MAX_REPLY_BYTES})"
            )
        frame = self.hs_codec.decode(_recv_exact(sock, size, deadline, fds))
        if not isinstance(frame, PipeFrame):
            raise MessageError(f"a {type(frame).__name__} instead of a registration")
        return _reg_decoder.decode(frame.payload)

    def _map(self, reg: _Registration, fds: list[int], pid: int, who: str) -> PeerMapping | None:
        """Map the peer's shared memory, validated (:class:`PeerMapping`); None where it
        shares none, where we do not map peers, or where ``/proc`` hides its mappings."""
        if not self.map_peers or not (fds or reg.shared):
            return None
        if rangecopy.load() is None:
            return None  # no native copy here: CMA it is (load() logged why, once)
        pieces = [Piece(*s) for s in reg.shared]
        try:
            mapping = PeerMapping(fds, pieces, pid, reg.regions)
        except FdUnverifiable as exc:
            log.warning("shm %r: %s's shared memory is not mapped (%s); it moves by "
                        "cross-memory attach", self.agent_name, who, exc)
            return None
        except FdRefused as exc:
            raise PeerUnreachable(f"{who} sent shared memory that is refused: {exc}") from None
        except OSError as exc:
            raise PeerUnreachable(f"{who}'s shared memory cannot be checked: {exc}") from None
        log.info("shm %r maps %d bytes of %s's memory (memcpy instead of cross-memory attach)",
                 self.agent_name, mapping.nbytes, who)
        return mapping


def _check(answer: _Registration | _Refused, meta: ShmMetadata, proof: bytes, pid: int,
           pidfd: int, who: str) -> _Registration:
    """``answer`` if it is a registration that matches the socket and the metadata."""
    if isinstance(answer, _Refused):
        raise PeerForged(f"the process behind {who}'s shm socket (pid {pid}) did not let "
                         f"this handshake in: {answer.reason}")
    problem = None
    if answer.proof != proof:
        problem = "did not echo the proof"
    elif answer.pid != pid:
        problem = f"answers as pid {answer.pid}, but the kernel says its socket is pid {pid}"
    elif answer.agent != meta.agent:
        problem = f"is agent {answer.agent!r}, but the metadata names agent {meta.agent!r}"
    elif answer.version < meta.version:
        problem = (f"answers registration version {answer.version}, older than the "
                   f"metadata's {meta.version}")
    elif not _alive(pidfd):
        problem = f"(process {pid}) exited during the handshake"
    if problem is not None:
        raise PeerUnreachable(f"the process behind {who}'s shm socket {problem}: refusing")
    return answer
