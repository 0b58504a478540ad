"""Who a peer is, proven: the handshake challenge and the proof its data plane must show.

An engine rank adds a peer only from the :class:`~kvbridge.messages.HelloReply` to its own
:class:`~kvbridge.messages.Hello` at an address it dialled. That reply is a *claim*: a rogue
endpoint could answer with another engine's :class:`~kvbridge.messages.EngineInfo` (which any
Hello obtains) and so point the dialler's data plane at the other engine's memory. Two checks
bind the data-plane peer to the dialled control address:

1. The reply's ``control_address`` must be the address dialled, exactly (an engine advertises
   the address it binds, and every dialler dials what was advertised: P's answer to the router,
   D's registration). Relaying another engine's info means rewriting it, which the frame's MAC
   forbids to anyone without the secret.
2. The Hello carries a fresh random :func:`challenge`. The engine answering it tells its *own*
   transport to :meth:`~kvbridge.transport.Transport.attest` the token :func:`proof` of
   ``(challenge, its own control address, its engine id, generation, rank, transport agent)``;
   the dialler
   computes the same token from the challenge it sent, the address it dialled and the identity
   the reply claims, and its transport's ``add_peer(metadata, proof)`` loads the peer only if
   that peer's data plane shows the token (shm: the kernel-proven process lets the query in only
   with it; NIXL, Mooncake: a READ of the peer's registered proof board must find it). An
   engine that never saw this Hello, or saw it relayed from another address, or is another
   engine, generation or rank than the reply claims, cannot show it.

The transport peer's name ``add_peer`` returns must then be the agent the reply claims.

Pure functions; thread-safe.
"""

from __future__ import annotations

import hashlib
import os

__all__ = ["CHALLENGE_BYTES", "PROOF_BYTES", "challenge", "proof", "agent_name"]

CHALLENGE_BYTES = 32
PROOF_BYTES = 32
_PERSON = b"kvbridge-proof1"


def challenge() -> bytes:
    """A fresh random challenge for one handshake."""
    return os.urandom(CHALLENGE_BYTES)


def proof(challenge: bytes, control_address: str, engine_id: str, generation: str,
          rank: int, agent: str) -> bytes:
    """The token the data plane of engine rank ``(engine_id, generation, rank)``, transport
    agent ``agent``, listening on ``control_address`` shows for ``challenge``
    (:data:`PROOF_BYTES` bytes)."""
    h = hashlib.blake2b(digest_size=PROOF_BYTES, person=_PERSON)
    for part in (challenge, control_address.encode(), engine_id.encode(), generation.encode(),
                 str(int(rank)).encode(), agent.encode()):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def agent_name(engine_id: str, generation: str, rank: int) -> str:
    """The transport agent name the core gives an engine rank's transport (a caller that
    brings its own transport may name it otherwise: :attr:`EngineInfo.agent` says)."""
    return f"{engine_id}:{generation}:{rank}"
