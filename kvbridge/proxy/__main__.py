"""``python -m kvbridge.proxy`` — same as ``kvbridge proxy``."""

from kvbridge.proxy.app import _cli

raise SystemExit(_cli())
