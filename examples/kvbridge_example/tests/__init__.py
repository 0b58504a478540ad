"""Tests of the example backend distribution (collected through the root testpaths)."""
