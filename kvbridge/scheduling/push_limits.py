"""Fair limits on the push registrations a prefill rank holds (P side of a push).

Registrations are counted per *decode control address* (the address P dials and handshakes,
identity checked, before it writes anything: the registrations naming an address that does not
answer as the registering engine all fail together) and per control connection; each may hold
``max_pending_per_peer``. Up to ``max_pending`` in all, that is the only bound. Past it, a
registration is admitted only if its control address holds fewer than its fair share,
``max_pending // addresses`` (at least 1; ``addresses`` counts those holding registrations, its
own included), so a flood from many connections cannot starve a decode engine that holds little:
its registrations still get in. Hard bound: at most ``2 × max_pending`` registrations in all
(refused beyond it whatever the share); a flood reaches it only by naming many distinct control
addresses that accept connections and stay silent, from at least ``2 × max_pending /
max_pending_per_peer`` connections, and holds it for at most ``control_timeout_s`` (then the
handshakes fail). Every refusal is an ``Ack`` of kind ``BUSY``, counted in
``register_refused_busy``; every registration gives its slot back when it ends (answered,
failed, cancelled, expired), once (:class:`~kvbridge.scheduling.push.PushSource` sees to the
once).

Loop thread only.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["RegistrationLimits"]

_K = TypeVar("_K", bytes, str)


def _decrement(counts: dict[_K, int], key: _K) -> None:
    n = counts.get(key, 1) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


class RegistrationLimits:
    """The registrations held now, and whether one more is admitted (see the module
    docstring): ``per_peer`` is ``max_pending_per_peer``, ``limit`` ``max_pending``."""

    def __init__(self, per_peer: int, limit: int) -> None:
        self.per_peer = per_peer
        self.limit = limit
        self._by_conn: dict[bytes, int] = {}
        self._by_peer: dict[str, int] = {}
        self._total = 0

    def held(self) -> dict[str, int]:
        """``{"total": n, "peers": control addresses holding some, "connections":
        connections holding some}``."""
        return {"total": self._total, "peers": len(self._by_peer),
                "connections": len(self._by_conn)}

    def refusal(self, conn: bytes, peer: str) -> str | None:
        """Why a registration from ``conn`` naming control address ``peer`` is refused now
        (None: admitted)."""
        per, limit = self.per_peer, self.limit
        if self._by_conn.get(conn, 0) >= per:
            return f"too many pending registrations on this connection ({per})"
        held = self._by_peer.get(peer, 0)
        if held >= per:
            return f"too many pending registrations for {peer[:200]} ({per})"
        if self._total < limit:
            return None
        if self._total >= 2 * limit:
            return f"too many pending registrations ({self._total}, the hard bound)"
        peers = len(self._by_peer) + (peer not in self._by_peer)
        share = max(1, limit // peers)
        if held < share:
            return None
        return (f"too many pending registrations ({self._total}); {peer[:200]} holds "
                f"{held}, its fair share of {limit} among {peers} decode engines")

    def take(self, conn: bytes, peer: str) -> None:
        """Count an admitted registration."""
        self._by_conn[conn] = self._by_conn.get(conn, 0) + 1
        self._by_peer[peer] = self._by_peer.get(peer, 0) + 1
        self._total += 1

    def give_back(self, conn: bytes, peer: str) -> None:
        """A counted registration ended."""
        self._total -= 1
        _decrement(self._by_conn, conn)
        _decrement(self._by_peer, peer)
