"""rolloutfleet: a kopf operator that moves vLLM rollout fleets to new policy weights, verified.

Importing this package must stay cheap and side-effect free: trainers import ``rolloutfleet.trainer``
without kopf running, and the sandbox imports it before any cluster exists.
"""

__version__ = "0.1.0"
