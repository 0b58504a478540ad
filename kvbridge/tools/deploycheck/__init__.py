"""Checks of the Kubernetes manifests in ``deploy/k8s`` (``python -m
kvbridge.tools.deploycheck.k8s``)."""
