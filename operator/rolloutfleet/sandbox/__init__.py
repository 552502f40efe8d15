"""The local control plane: Go-built Kubernetes binaries, cluster lifecycle, fake GPU nodes.

Called by the `rolloutfleet sandbox` CLI and by the pytest fixtures in ``tests/``; owns nothing that the
operator itself needs at run time.
"""
