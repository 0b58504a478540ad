"""W3C trace context, shared by the proxy's spans and the engines' hand-off spans.

Pure and total: :func:`parse_traceparent` gives a :class:`TraceParent` or None for any string
(oversized, non-ASCII, wrong version, all-zero ids), never a raise. No OpenTelemetry import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["TraceParent", "parse_traceparent", "TRACEPARENT_MAX"]

#: longest ``traceparent`` read (version 00 is 55 characters; later versions may append)
TRACEPARENT_MAX = 256
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?",
                          re.ASCII | re.DOTALL)


@dataclass(frozen=True)
class TraceParent:
    """A W3C trace context: the trace, the parent span in it, the flags (bit 0: sampled)."""

    trace_id: int
    span_id: int
    flags: int

    def header(self) -> str:
        """As a version-00 ``traceparent`` header value."""
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{self.flags:02x}"


def parse_traceparent(value: str | None) -> TraceParent | None:
    """A ``traceparent`` header's trace context, or None when it is not a valid one (W3C Trace
    Context: lower-case hex, version ``ff`` invalid, version 00 exactly 55 characters, later
    versions may append ``-…``, trace and span ids not all zeros; at most
    :data:`TRACEPARENT_MAX` characters)."""
    if not isinstance(value, str) or len(value) > TRACEPARENT_MAX:
        return None
    m = _TRACEPARENT.fullmatch(value.strip(" \t"))
    if m is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = m.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if trace_id == 0 or span_id == 0:
        return None
    return TraceParent(trace_id, span_id, int(flags_hex, 16))
