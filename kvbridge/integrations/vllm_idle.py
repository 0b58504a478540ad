"""Wake on arrival: kvbridge's one hook into vLLM's EngineCore idle path (imports vLLM lazily).

**What vLLM does.** While its only requests wait for remote KV (``WAITING_FOR_REMOTE_KVS``) or
for a connector to free their blocks, vLLM's ``EngineCoreProc`` keeps stepping: each empty step
goes to the workers and back, then ``_process_engine_step`` sleeps a fixed millisecond
(``time.sleep(0.001)``) and steps again. So a completed receive waited out that sleep between the
step that reported it (``finished_recving``) and the step that scheduled the request — twice
with asynchronous scheduling (GPUs; vLLM turns it off on CPU), where a worker's answer is read
one step after the step that carried it — and new client requests waited behind whatever
kvbridge's own idle wait (``idle_wait_ms``, formerly inside ``build_connector_meta``) was doing.

**What the hook changes.** Exactly that sleep, and only while kvbridge has something to say about
it: :func:`install` replaces ``time`` in ``vllm.v1.engine.core`` with a copy whose ``sleep``
asks the registered *waiter* (the connector's scheduler side) instead, when it is called from
inside ``EngineCoreProc._process_engine_step`` on the engine thread. The waiter returns at once
when work is due (a hand-off just finished), or blocks on the engine's own ``input_queue`` —
so a client request, an abort, a utility call or a shutdown ends the wait exactly as it ends
vLLM's own idle wait — and :func:`nudge` (called when a worker's transfer loop reports
progress) puts vLLM's ``WAKEUP`` message on that queue. Every other use of ``time`` in that module
is the real one.

**Direct arrival.** The same wrapper around ``_process_engine_step`` runs the registered
*before_step* callback on the engine thread just before each step schedules, and
:func:`deliver_received` tells vLLM's scheduler that receives finished exactly as a worker's
step output would (``Scheduler._update_from_kv_xfer_finished`` with only ``finished_recving``),
for requests that still wait for remote KV. The connector uses both to schedule a request the
step after its KV arrived rather than the step after a worker reported it
(:mod:`kvbridge.integrations.vllm`). :func:`deliverable` checks the scheduler's structure first;
a *before_step* that raises is logged once and dropped.

**Safety.** :func:`install` checks the structure it relies on (the class, the method, the one
``time.sleep`` call in its source, ``EngineCoreRequestType.WAKEUP``) and otherwise logs one
WARNING and changes nothing: the connector then keeps its older idle wait. A waiter that raises
is logged once and uninstalled (vLLM's plain sleep again), never propagated into the engine.
The engine-loop thread is the only caller of the waiter; :func:`nudge` may be called from any
thread.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import queue
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

__all__ = ["Waiter", "BeforeStep", "install", "installable", "active", "nudge", "uninstall",
           "status", "deliverable", "deliver_received", "weight_version"]

log = logging.getLogger("kvbridge.connector")

Waiter = Callable[["queue.Queue[Any]", float], None]
"""``waiter(input_queue, seconds)``: replaces vLLM's idle ``time.sleep(seconds)``; must return
(at once, or after a bounded wait on ``input_queue``) and must not raise."""

BeforeStep = Callable[[Any], None]
"""``before_step(engine)``: runs on the engine thread before each ``_process_engine_step``."""

_MODULE = "vllm.v1.engine.core"
_lock = threading.Lock()
_local = threading.local()
_waiter: Waiter | None = None
_before_step: BeforeStep | None = None
_engine: Any = None  # the EngineCoreProc whose loop ran the hook last
_installed = False
_status = "not installed"
_original_step: Any = None
_original_time: types.ModuleType | None = None
_WAKEUP: Any = None  # vLLM's EngineCoreRequestType.WAKEUP, once installed


def status() -> str:
    """One line: installed, not installed (why), or uninstalled after a failure."""
    return _status


def active() -> bool:
    """True once the hook has run inside vLLM's engine loop in this process (so the waiter
    really replaces the idle sleep there)."""
    return _installed and _engine is not None


def weight_version() -> str | None:
    """The weight version vLLM's engine reports (``finish_weight_update(weight_version=…)``,
    ``set_weight_version``), or None: no engine seen yet, or vLLM's ``"default"``."""
    version = getattr(_engine, "_weight_version", None)
    return version if isinstance(version, str) and version and version != "default" else None


def nudge() -> bool:
    """Wake the engine loop if it waits in the hook (any thread; never blocks). False when no
    engine is known yet (the hook has not run) or the hook is not installed."""
    engine = _engine
    if not _installed or engine is None:
        return False
    try:
        engine.input_queue.put_nowait((_WAKEUP, None))
    except Exception:  # noqa: BLE001 - a nudge is best effort; the wait is bounded anyway
        return False
    return True


def _check(core: types.ModuleType) -> str | None:
    """Why the hook cannot be installed in this vLLM, or None when it can."""
    proc = getattr(core, "EngineCoreProc", None)
    step = getattr(proc, "_process_engine_step", None)
    if proc is None or not callable(step):
        return "vLLM has no EngineCoreProc._process_engine_step"
    if getattr(core, "time", None) is not time:
        return f"{_MODULE}.time is not the time module (patched by someone else?)"
    try:
        from vllm.v1.engine import EngineCoreRequestType
    except ImportError:
        return "vLLM has no EngineCoreRequestType"
    if not hasattr(EngineCoreRequestType, "WAKEUP"):
        return "vLLM's EngineCoreRequestType has no WAKEUP"
    try:
        source = inspect.getsource(step)
    except (OSError, TypeError):
        return "the source of EngineCoreProc._process_engine_step is not available"
    if source.count("time.sleep(") != 1:
        return "EngineCoreProc._process_engine_step no longer has exactly one time.sleep()"
    return None


def installable() -> str | None:
    """Why the hook cannot be installed in this process's vLLM, or None when it can (nothing is
    changed; ``kvbridge doctor`` asks this)."""
    if _installed:
        return None
    try:
        core = importlib.import_module(_MODULE)
    except Exception as exc:  # noqa: BLE001 - any import problem: no hook
        return f"cannot import {_MODULE}: {exc}"
    return _check(core)


def install(waiter: Waiter, before_step: BeforeStep | None = None) -> bool:
    """Route vLLM's idle sleep in this process to *waiter*, and run *before_step* before each
    engine step (idempotent: a later call only replaces both). False, after one WARNING, when
    this vLLM does not have the structure the hook needs; nothing is changed then."""
    global _waiter, _before_step, _installed, _status, _original_step, _original_time, _WAKEUP
    with _lock:
        if _installed:
            _waiter, _before_step = waiter, before_step
            return True
        why = installable()
        if why is not None:
            _status = f"not installed: {why}"
            log.warning("kvbridge wake-on-arrival hook not installed (%s): an engine waiting "
                        "for a hand-off polls every 1 ms .. idle_wait_ms instead", why)
            return False
        core = sys.modules[_MODULE]
        proc = core.EngineCoreProc
        original = proc._process_engine_step

        def _process_engine_step(self: Any) -> Any:
            global _engine
            _engine = self
            if _before_step is not None:
                _run_before_step(self)
            _local.inside = True
            try:
                return original(self)
            finally:
                _local.inside = False

        _process_engine_step.__wrapped__ = original  # type: ignore[attr-defined]
        clock = types.ModuleType("time", time.__doc__)
        clock.__dict__.update({k: v for k, v in vars(time).items() if not k.startswith("__")})
        clock.sleep = _sleep  # type: ignore[attr-defined]
        from vllm.v1.engine import EngineCoreRequestType

        _WAKEUP = EngineCoreRequestType.WAKEUP
        _original_step, _original_time = original, time
        proc._process_engine_step = _process_engine_step
        core.time = clock  # type: ignore[attr-defined]
        _waiter, _before_step = waiter, before_step
        _installed = True
        import vllm

        _status = f"installed (vLLM {getattr(vllm, '__version__', '?')})"
        log.info("kvbridge wake-on-arrival hook installed in vLLM %s's engine loop",
                 getattr(vllm, "__version__", "?"))
        return True


def uninstall() -> None:
    """Restore vLLM's own idle sleep (idempotent). Used after a waiter failed, and by tests."""
    global _waiter, _before_step, _installed, _engine, _status
    with _lock:
        if not _installed:
            return
        core = sys.modules.get(_MODULE)
        if core is not None:
            core.EngineCoreProc._process_engine_step = _original_step
            core.time = _original_time  # type: ignore[attr-defined]
        _installed = False
        _waiter = _before_step = None
        _engine = None
        if not _status.startswith("uninstalled"):
            _status = "uninstalled"


def _sleep(seconds: float) -> None:
    """``time.sleep`` as ``vllm.v1.engine.core`` sees it."""
    global _status
    waiter, engine = _waiter, _engine
    if waiter is None or engine is None or not getattr(_local, "inside", False):
        time.sleep(seconds)
        return
    try:
        waiter(engine.input_queue, seconds)
    except Exception:  # noqa: BLE001 - never into vLLM's loop: fall back to its own sleep
        log.exception("kvbridge idle waiter failed; restoring vLLM's idle sleep")
        _status = "uninstalled: the waiter raised"
        uninstall()
        time.sleep(seconds)


def _run_before_step(engine: Any) -> None:
    global _before_step
    callback = _before_step
    if callback is None:
        return
    try:
        callback(engine)
    except Exception:  # noqa: BLE001 - never into vLLM's loop
        log.exception("kvbridge before-step callback failed; direct arrival is off from now on")
        _before_step = None


def deliverable(engine: Any, connector: Any) -> str | None:
    """Why :func:`deliver_received` cannot be used with ``engine``'s scheduler, or None when
    it can: the scheduler must be vLLM's (``_update_from_kv_xfer_finished``, ``requests``,
    ``finished_recving_kv_req_ids``), and ``connector`` must be its connector (under vLLM's
    MultiConnector the other connectors would see the receives too)."""
    sched = getattr(engine, "scheduler", None)
    if sched is None:
        return "the engine has no scheduler"
    if not callable(getattr(sched, "_update_from_kv_xfer_finished", None)):
        return "the scheduler has no _update_from_kv_xfer_finished"
    if not isinstance(getattr(sched, "finished_recving_kv_req_ids", None), set) \
            or not isinstance(getattr(sched, "failed_recving_kv_req_ids", None), set) \
            or not isinstance(getattr(sched, "requests", None), dict):
        return "the scheduler does not keep requests and finished receives as expected"
    if getattr(sched, "connector", None) is not connector:
        return "kvbridge is not the scheduler's only KV connector"
    try:
        from vllm.v1.outputs import KVConnectorOutput  # noqa: F401
        from vllm.v1.request import RequestStatus

        RequestStatus.WAITING_FOR_REMOTE_KVS  # noqa: B018
    except (ImportError, AttributeError) as exc:
        return f"vLLM lacks what a delivery needs: {exc}"
    return None


def deliver_received(engine: Any, req_ids: set[str]) -> set[str]:
    """Engine thread only, after :func:`deliverable` said yes. Tell ``engine``'s scheduler that
    the receives of ``req_ids`` finished, exactly as a worker's step output would, for those
    that still wait for their remote KV (and have not been reported finished or failed yet);
    returns the ones told. The workers report them again later: the connector must drop them
    from that output (``update_connector_output`` runs before vLLM reads it)."""
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    sched = engine.scheduler
    requests = sched.requests
    ready = set()
    for req_id in req_ids:
        request = requests.get(req_id)
        if (request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                and req_id not in sched.finished_recving_kv_req_ids
                and req_id not in sched.failed_recving_kv_req_ids):
            ready.add(req_id)
    if ready:
        sched._update_from_kv_xfer_finished(KVConnectorOutput(finished_recving=set(ready)))
    return ready
