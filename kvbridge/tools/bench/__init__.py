"""Benchmarks that compare side by side in one run (``kvbridge bench …``)."""
