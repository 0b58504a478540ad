"""NIXL backend for kvbridge (entry point ``nixl``): UCX by default, LIBFABRIC for AWS EFA.

Importing this package is cheap: nixl is imported only when a :class:`NixlTransport` is
constructed (or :meth:`NixlTransport.probe` is called). The benches' hook (NIXL alone, for the
"raw" columns) is :mod:`kvbridge_nixl.bench`. See ``docs/backends/nixl.md`` and ``docs/efa.md``.
"""

from kvbridge_nixl.transport import NixlTransport

__all__ = ["NixlTransport"]
