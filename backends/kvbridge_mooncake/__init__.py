"""Mooncake Transfer Engine backend for kvbridge (work in progress)."""
