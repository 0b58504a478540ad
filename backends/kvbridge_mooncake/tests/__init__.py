"""Tests of the mooncake backend distribution (collected through the root testpaths)."""
