"""Stand-in put first on PYTHONPATH by tests/integration/test_demo.py: the demo must never import torch."""

raise ImportError("the sandbox demo imported torch (it serves simulated engines and must not need it)")
