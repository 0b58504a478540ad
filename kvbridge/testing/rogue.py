"""A rogue control endpoint for tests: it presents another engine's identity (issue 25).

The rogue of ../shared/security-pocs/poc_relay_metadata.py, made as strong as it can be: it
holds whatever codec it is given (the fleet's secret, for an insider), answers every Hello at
its own address with the victim's identity, and says yes to everything else. Engines must refuse
it in every mode (:data:`MODES`); ``tests/process/test_identity.py`` (transfer loops) and
``tests/engines/test_vllm_faults.py`` (real engines) check that they do.

For tests only: it runs one daemon thread on a ROUTER socket bound to 127.0.0.1; :meth:`close`
stops it and closes the socket.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import msgspec
import zmq

from kvbridge.control import ControlClient, reply_context, request_context
from kvbridge.messages import Ack, Codec, EngineInfo, Heartbeat, HeartbeatReply, Hello, HelloReply

__all__ = ["MODES", "Rogue"]

#: how the rogue presents the victim (see :class:`Rogue`)
MODES = ("rewrite", "relay", "relay-rewrite", "impersonate")


class Rogue(threading.Thread):
    """A control endpoint that presents ``victim``'s identity and says yes to everything.

    ``rewrite``: the victim's info (fetched with a Hello of its own) with the control address
    rewritten to the rogue's; ``relay``: forwards each Hello, challenge included, to the victim
    and returns the victim's genuine answer; ``relay-rewrite``: forwards, then rewrites the
    address; ``impersonate``: the victim's transport metadata under the rogue's own engine id.
    """

    def __init__(self, victim: str, me: EngineInfo, codec: Codec, mode: str) -> None:
        super().__init__(daemon=True)
        self.codec, self.mode, self.victim = codec, mode, victim
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.client = ControlClient(codec, 5.0)
        self.info = self._ask(os.urandom(32), me)
        self.seen: list[str] = []
        self.stop = False
        self.errors: list[str] = []
        self.start()

    def _ask(self, challenge: bytes, me: EngineInfo) -> EngineInfo:
        reply = self.client.request(self.victim, Hello(info=me, challenge=challenge))
        assert isinstance(reply, HelloReply)
        return reply.info

    def _hello(self, msg: Hello) -> EngineInfo:
        mine = {"control_address": self.address}
        if self.mode == "rewrite":
            return msgspec.structs.replace(self.info, **mine)
        if self.mode == "impersonate":
            return msgspec.structs.replace(self.info, engine_id="rogue", **mine)
        genuine = self._ask(msg.challenge, msg.info)
        return genuine if self.mode == "relay" else msgspec.structs.replace(genuine, **mine)

    def run(self) -> None:
        while not self.stop:
            if not self.sock.poll(50):
                continue
            conn, rid, data = self.sock.recv_multipart()
            try:
                msg = self.codec.decode(data, request_context(rid))
            except Exception as exc:  # noqa: BLE001 - a rogue keeps going
                self.errors.append(repr(exc))
                continue
            self.seen.append(type(msg).__name__)
            if isinstance(msg, Hello):
                try:
                    reply: Any = HelloReply(info=self._hello(msg))
                except Exception as exc:  # noqa: BLE001 - e.g. the victim is gone
                    self.errors.append(repr(exc))
                    continue
            elif isinstance(msg, Heartbeat):
                reply = HeartbeatReply(generation=self.info.generation, unknown=[])
            else:
                reply = Ack()
            self.sock.send_multipart([conn, rid, self.codec.encode(reply, reply_context(rid))])

    def close(self) -> None:
        self.stop = True
        self.join(5)
        self.client.close()
        self.sock.close()
