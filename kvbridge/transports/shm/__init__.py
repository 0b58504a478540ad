"""The built-in same-host transport: one-sided READ/WRITE with ``process_vm_readv/writev``.

``shm`` moves bytes between two processes on one Linux host with cross-memory attach (CMA): the
kernel copies straight from one address space into the other, zero intermediate copies. The
descriptor arrays become ``struct iovec`` arrays with one vectorised numpy copy (an ``(N, 2)``
``uint64`` array is exactly ``N`` iovecs) and are handed to the kernel 1024 (``IOV_MAX``) at a
time; nothing loops over descriptors in Python.

Trust: a peer's metadata arrives over the network and is never believed. It only says where to
ask: each transport listens on an abstract Unix socket with a random name. ``add_peer(metadata,
proof)`` connects there, lets the kernel say who listens (``SO_PEERCRED``: pid and uid, which the
listener cannot choose), refuses another user, a pid other than the one the metadata claims, or
an agent name other than the one the process itself answers with, and then asks that process,
over the same connection, for its *current* registration (agent, regions, notification address),
showing the ``proof`` of this handshake (:mod:`kvbridge.identity`). The listener answers only a
query whose proof its own engine attested (:meth:`ShmTransport.attest`, when its control plane
answered the dialler's authenticated Hello) for the very process that connects (the pid the
Hello's metadata names, checked against ``SO_PEERCRED``), once; anyone else — a process of the
same user in another container or PID namespace, a relayed or replayed handshake — gets a
refusal and nothing else: no regions, no memfd. Every CMA call uses the kernel-proven pid, and
every remote descriptor is checked against the regions the proven process answered (local ones
against ours) before any byte moves. The listener also watches each peer's pidfd: the moment a
peer's process exits it is forgotten, its mapped memory unmapped, and the core told
(:meth:`~kvbridge.transport.Transport.on_peer_lost`). See ``docs/backends/shm.md`` and
``docs/security.md``.

Contract (on top of :mod:`kvbridge.transport`):

* ``register_memory`` records host-DRAM regions and calls ``prctl(PR_SET_PTRACER,
  PR_SET_PTRACER_ANY)``, so a sibling process may attach to us under Yama ``ptrace_scope=1``
  (this widens who may ptrace this process to every process of the same user; ``ptrace_scope``
  2 or 3 forbids CMA altogether and transfers fail with a message saying so). It returns msgpack
  metadata (:class:`ShmMetadata`): agent name, claimed pid, hostname, boot id, PID namespace, the
  listener's socket name and a registration version. Call it again to add regions (the version
  goes up), then resend the metadata: re-adding the peer fetches the registration again.
* ``add_peer`` decodes the metadata strictly (:class:`MessageError` for anything malformed,
  oversized or of another version), refuses another host (boot id) or PID namespace, then runs
  the socket handshake above (:class:`PeerUnreachable` naming the mismatch, bounded by
  ``handshake_timeout``) and probes one byte of the peer's memory, so a permission problem is
  reported at handshake time rather than on the first transfer. It blocks for one local round
  trip (well under a millisecond when the peer is healthy).
* ``submit`` validates local descriptors against our regions and remote ones against the peer's
  proven ones (:class:`DescriptorError`) and queues the transfer; one background worker thread
  executes transfers in submission order and finishes their handles. A transfer to a peer whose
  process has exited since the handshake fails without a system call (a pidfd says so, so a
  recycled pid is never written to). A transfer's notification is sent after all its bytes
  landed, and only if it succeeded. ``poll`` never blocks.
* Transfers by block id (:class:`~kvbridge.blocks.BlockTransport`, the core's path): preparing
  checks both layouts against the registered and the proven regions once; ``submit_blocks``
  validates the ids (O(blocks)) and queues; the worker builds the iovecs from the plane tables.
  A request prepared ahead (``prepare_request``, as the connector builds a push's WRITE during
  the forward) has its iovecs built then, so posting it only queues.
  With the ``threads`` option, a transfer of at least ``split_bytes`` is copied in that many
  parts at once; it finishes (and notifies) when every part stopped.
* The listener is one daemon thread answering each connection once: at most
  ``listener_max_connections`` at a time, requests of at most 4 KiB, each connection closed after
  ``listener_timeout`` seconds, clients of another user refused; garbage closes the connection
  and is counted, never raised.
* Notifications travel over ZeroMQ on the control network (:mod:`kvbridge.transports.notify`),
  ordered per peer. The inbox authenticates frames with the ``secret`` option (the core must
  pass its shared secret there) and holds at most ``max_notifications`` messages /
  ``max_notification_bytes``; refused and overflowing frames are dropped and counted
  (:attr:`ShmTransport.dropped_notifications`).
* ``close`` waits up to ``timeout`` for queued transfers, then fails the rest (a transfer cut
  between two batches is FAILED; nothing lands after ``close`` returns), closes the sockets and
  joins every thread. Idempotent.

Options: ``notify_host`` (bind address of the inbox, default ``127.0.0.1``), ``notify_port``
(default 0: any free port), ``secret`` (HMAC key of notification and handshake frames; both sides
must agree), ``iov_max`` (iovecs per system call, default 1024), ``handshake_timeout`` (seconds,
default 5), ``listener_timeout`` (seconds per inbound connection, default 2),
``listener_max_connections`` (default 16), ``max_notifications`` (default 4096),
``max_notification_bytes`` (default 4 MiB), ``threads`` (default 2, or 1 on a one-CPU host),
``split_bytes`` (default 16 MiB), ``map_memory`` (default false: see below), ``map_peers``
(default true).

Mapped copies (:mod:`.memfd`): with ``map_memory``, ``register_memory`` moves the whole pages
of the regions onto one sealed memfd (same addresses, same bytes; the connector turns it on for
a CPU engine's KV cache, which nothing writes yet and nothing pins) and the listener hands that
memfd to a peer that asks, over the same Unix socket (``SCM_RIGHTS``). With ``map_peers``, the
handshake asks for it, validates it (a sealed tmpfs memfd that the proven process maps at the
claimed addresses, inside its regions; anything else is :class:`PeerUnreachable`) and maps it;
a transfer then copies the ranges the mapping holds with ``memmove`` in this process, and the
rest by CMA. Same bytes, same ordering and notification rules; a peer that exited fails the
transfer as CMA would. :attr:`ShmTransport.mapped_bytes` / :attr:`ShmTransport.cma_bytes` count
how each byte moved. Registered memory must stay allocated until ``close``, which gives the
shared pages back private ones (same bytes), so that heap memory reused after it is freed is
never shared with a forked child.

The modules, one job each: :mod:`.wire` (the metadata and the handshake's messages),
:mod:`.cma` (the system calls: cross-memory attach, iovecs, peer credentials and pidfds),
:mod:`.listener` (the socket that answers attested diallers and watches peers' pidfds),
:mod:`.proof` (the dialler's side of the handshake: a proven peer), :mod:`.worker` (the
thread that runs transfers), :mod:`.transport` (:class:`ShmTransport`), :mod:`.memfd`
(registered memory on a sealed memfd; a peer's, validated and mapped) and :mod:`.rangecopy`
(the native copy of mapped ranges). This package re-exports what ``kvbridge.transports.shm``
offered as one module, private names included (tests and proofs of concept use them).
"""

from __future__ import annotations

from kvbridge.transports.shm.cma import IOV_MAX as IOV_MAX
from kvbridge.transports.shm.cma import IovArray as IovArray
from kvbridge.transports.shm.cma import _alive as _alive
from kvbridge.transports.shm.cma import _boot_id as _boot_id
from kvbridge.transports.shm.cma import _explain as _explain
from kvbridge.transports.shm.cma import _iov as _iov
from kvbridge.transports.shm.cma import _Libc as _Libc
from kvbridge.transports.shm.cma import _peer_pidfd as _peer_pidfd
from kvbridge.transports.shm.cma import _peercred as _peercred
from kvbridge.transports.shm.cma import _pid_ns as _pid_ns
from kvbridge.transports.shm.cma import _poller as _poller
from kvbridge.transports.shm.cma import copy_iovecs as copy_iovecs
from kvbridge.transports.shm.cma import split_iovecs
from kvbridge.transports.shm.listener import _SOCKET_PREFIX as _SOCKET_PREFIX
from kvbridge.transports.shm.listener import _Conn as _Conn
from kvbridge.transports.shm.listener import _Listener as _Listener
from kvbridge.transports.shm.listener import _NotLetIn as _NotLetIn
from kvbridge.transports.shm.proof import Dialler as Dialler
from kvbridge.transports.shm.proof import _Peer as _Peer
from kvbridge.transports.shm.proof import _recv_exact as _recv_exact
from kvbridge.transports.shm.proof import _send_all as _send_all
from kvbridge.transports.shm.transport import DEFAULT_THREADS, ShmTransport
from kvbridge.transports.shm.wire import _MAX_ADDR as _MAX_ADDR
from kvbridge.transports.shm.wire import _MAX_REPLY_BYTES as _MAX_REPLY_BYTES
from kvbridge.transports.shm.wire import _MAX_REQUEST_BYTES as _MAX_REQUEST_BYTES
from kvbridge.transports.shm.wire import (
    MAX_METADATA_BYTES,
    MAX_REGIONS,
    ShmMetadata,
    decode_metadata,
)
from kvbridge.transports.shm.wire import _decoder as _decoder
from kvbridge.transports.shm.wire import _encoder as _encoder
from kvbridge.transports.shm.wire import _Query as _Query
from kvbridge.transports.shm.wire import _query_decoder as _query_decoder
from kvbridge.transports.shm.wire import _Refused as _Refused
from kvbridge.transports.shm.wire import _reg_decoder as _reg_decoder
from kvbridge.transports.shm.wire import _Registration as _Registration

__all__ = [
    "ShmTransport",
    "ShmMetadata",
    "IOV_MAX",
    "DEFAULT_THREADS",
    "MAX_METADATA_BYTES",
    "MAX_REGIONS",
    "decode_metadata",
    "split_iovecs",
]
