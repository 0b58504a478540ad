"""Tests of the nixl backend distribution (collected through the root testpaths)."""
