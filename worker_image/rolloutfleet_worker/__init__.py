"""rolloutfleet_worker: what the rolloutfleet vLLM image adds to stock vLLM.

Loaded by vLLM itself, never by the operator: ``--worker-extension-cls
rolloutfleet_worker.extension.RolloutFleetExtension`` (in-place verifier/draft loads with digests, a state
report) and ``--middleware rolloutfleet_worker.auth.ControlAuthMiddleware`` (bearer token on every control
route). ``rolloutfleet_worker.digest`` is the one module the operator may import (pure Python + blake3).
Kept empty of imports so that importing any submodule stays cheap and torch/vLLM-free.
"""

__all__: list[str] = []
