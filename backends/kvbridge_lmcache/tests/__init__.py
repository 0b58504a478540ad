"""Tests of the lmcache backend distribution (collected through the root testpaths)."""
