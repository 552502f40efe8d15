"""Pure builders of the Kubernetes manifests a fleet owns (StatefulSet, Services, NetworkPolicy, PDB,
Secret) and of the vLLM command line.

Called by ``rolloutfleet.reconcile``; pinned by golden tests in ``tests/unit/resources``.
"""
