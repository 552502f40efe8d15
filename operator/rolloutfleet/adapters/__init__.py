"""The adapters layer: the operator's only I/O (the engines' HTTP surface; the Kubernetes API).

Called by ``rolloutfleet.reconcile``; never imported by ``api``, ``planning`` or ``resources``
(import-linter enforces it).
"""
