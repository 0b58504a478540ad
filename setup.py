"""Build hook for what pyproject.toml cannot declare: shm's native range copy.

Everything else (metadata, packages, entry points) is in pyproject.toml. The extension is
``optional``: where no C compiler works, kvbridge still builds and installs, and the shm transport
moves bytes by cross-memory attach (``kvbridge doctor`` says so). Editable installs
(``pip install --no-deps -e .``) build it into the source tree, next to rangecopy.py.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvbridge.transports.shm._rangecopy",
            sources=["kvbridge/transports/shm/_rangecopy.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
