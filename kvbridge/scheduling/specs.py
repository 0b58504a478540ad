"""What the connector asks a transfer loop to do: plain, frozen values, no behaviour.

P hands over a :class:`SendPlan` (the prompt's blocks, staged for a pull or written by a push);
D asks for a :class:`PullSpec` (read the blocks) or a :class:`PushSpec` (wait for P to write
them), each naming every prefill rank it receives from (:class:`Source`; several with
heterogeneous TP). The state machines of :mod:`kvbridge.scheduling.pull`,
:mod:`~kvbridge.scheduling.push` and :mod:`~kvbridge.scheduling.push_wait` act on them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.scheduling.peers import ANY_GENERATION

__all__ = ["SendPlan", "Source", "PullSpec", "PushSpec"]


@dataclass(frozen=True)
class SendPlan:
    """P: one request's prompt blocks, ready to hand to a decode engine."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    prompt_digest: str
    layerwise: bool = False


@dataclass(frozen=True)
class Source:
    """A prefill rank a decode rank receives from: where it listens, which generation, and
    which rank of which TP size the request says it is (None: the rank of this rank)."""

    address: str
    generation: str = ANY_GENERATION
    rank: int | None = None
    tp_size: int | None = None


@dataclass(frozen=True)
class PullSpec:
    """D: read the prompt's blocks from ``skip_blocks`` on (``remote_ids`` at the engine at
    ``peer_address``, generation ``peer_generation``) into ``local_ids``.

    Heterogeneous TP / block size: ``sources`` are every prefill rank this rank reads from
    (default: ``peer_address`` alone) and ``remote_ids`` start at prefill's block
    ``remote_skip`` (default ``skip_blocks``; it differs when the block sizes do)."""

    req_id: str
    transfer_id: str
    peer_address: str
    local_ids: tuple[int, ...]
    remote_ids: tuple[int, ...]
    skip_blocks: int = 0
    num_tokens: int = 0
    prompt_digest: str = ""
    peer_generation: str = ANY_GENERATION
    remote_skip: int | None = None
    sources: tuple[Source, ...] = ()

    def parts(self) -> tuple[Source, ...]:
        return self.sources or (Source(self.peer_address, self.peer_generation),)


@dataclass(frozen=True)
class PushSpec:
    """D: ask the engine at ``peer_address`` to write the prompt's blocks from ``skip_blocks``
    on into ``local_ids`` (``sources``: every prefill rank that writes heads of this rank, with
    heterogeneous TP; default ``peer_address`` alone)."""

    req_id: str
    transfer_id: str
    peer_address: str
    local_ids: tuple[int, ...]
    skip_blocks: int = 0
    num_tokens: int = 0
    prompt_digest: str = ""
    peer_generation: str = ANY_GENERATION
    sources: tuple[Source, ...] = ()

    def parts(self) -> tuple[Source, ...]:
        return self.sources or (Source(self.peer_address, self.peer_generation),)
