"""Plans and specs built the way the connector builds them, for transfer-loop tests."""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.scheduling.planner import prompt_digest
from kvbridge.scheduling.specs import PullSpec, PushSpec, SendPlan
from kvbridge.testing.agents import Agent

__all__ = ["BLOCK", "FAST", "tokens", "send", "pull", "expect"]
BLOCK = 16  # tokens per block in the default cache shape (2, 64, 16, 64)
FAST = {"lease_s": 3, "heartbeat_s": 0.5, "push_timeout_s": 4, "control_timeout_s": 2,
        "transfer_timeout_s": 2, "gone_grace_s": 0.2}


def tokens(n_blocks: int, seed: int = 0) -> list[int]:
    return [seed * 1000 + i for i in range(n_blocks * BLOCK)]


def send(req: str, tid: str, ids: Sequence[int], prompt: Sequence[int] | None = None,
         layerwise: bool = False) -> SendPlan:
    prompt = list(prompt) if prompt is not None else tokens(len(ids))
    return SendPlan(req, tid, tuple(ids), len(prompt), prompt_digest(prompt), layerwise)


def pull(req: str, tid: str, p: Agent, local: Sequence[int], remote: Sequence[int],
         prompt: Sequence[int] | None = None, skip: int = 0,
         generation: str | None = None) -> PullSpec:
    prompt = list(prompt) if prompt is not None else tokens(len(local) + skip)
    return PullSpec(req, tid, p.address, tuple(local), tuple(remote), skip, len(prompt),
                    prompt_digest(prompt), generation or p.generation)


def expect(req: str, tid: str, p: Agent, local: Sequence[int],
           prompt: Sequence[int] | None = None, skip: int = 0,
           generation: str | None = None) -> PushSpec:
    prompt = list(prompt) if prompt is not None else tokens(len(local) + skip)
    return PushSpec(req, tid, p.address, tuple(local), skip, len(prompt),
                    prompt_digest(prompt), generation or p.generation)


