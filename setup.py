"""Build hook for what pyproject.toml cannot declare: shm's native range copy and the native
hand-off digests (both include ``kvbridge/_share.h``: a call's work shared with a helper thread).

Everything else (metadata, packages, entry points) is in pyproject.toml. Both extensions are
``optional``: where no C compiler works, kvbridge still builds and installs, the shm transport
moves bytes by cross-memory attach (``kvbridge doctor`` says so) and the hand-off digests are
hashed in Python. Editable installs (``pip install --no-deps -e .``) build them into the source
tree, next to their Python sides.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvbridge.transports.shm._rangecopy",
            sources=["kvbridge/transports/shm/_rangecopy.c"],
            depends=["kvbridge/_share.h"],
            extra_compile_args=["-O2", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "kvbridge.scheduling._digest",
            sources=["kvbridge/scheduling/_digest.c"],
            depends=["kvbridge/_share.h"],
            extra_compile_args=["-O2", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
    ]
)
