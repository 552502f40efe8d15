"""rolloutfleet_worker: what the rolloutfleet vLLM image adds to stock vLLM.

Loaded by vLLM itself, never by the operator: ``--worker-extension-cls
rolloutfleet_worker.extension.RolloutFleetExtension`` (in-place verifier/draft loads with digests, a state
report) and ``--middleware rolloutfleet_worker.auth.ControlAuthMiddleware`` (bearer token on every control
route). The digest definition it shares with the operator is ``rolloutfleet_digest`` (digest/, its own
distribution), so this package and the operator never ship in each other's image.
Kept empty of imports so that importing any submodule stays cheap and torch/vLLM-free.
"""

__all__: list[str] = []
