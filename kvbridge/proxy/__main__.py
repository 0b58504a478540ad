"""``python -m kvbridge.proxy`` — same as ``kvbridge proxy``."""

from kvbridge.proxy.cli import run

raise SystemExit(run())
