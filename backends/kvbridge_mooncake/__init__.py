"""Mooncake Transfer Engine backend for kvbridge (entry point ``mooncake``).

Importing this package is cheap: ``mooncake.engine`` is imported only when a
:class:`MooncakeTransport` is constructed (or :meth:`MooncakeTransport.probe` is called). The
benches' hook (the engine alone) is :mod:`kvbridge_mooncake.bench`. See
``docs/backends/mooncake.md``.
"""

from kvbridge_mooncake.transport import MooncakeTransport

__all__ = ["MooncakeTransport"]
