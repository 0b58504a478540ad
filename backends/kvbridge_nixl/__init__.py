"""NIXL backend for kvbridge (work in progress)."""
