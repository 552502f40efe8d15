"""The control token the middleware tests mount (tests/unit/worker/conftest.py's ``token_file``) and send."""

TOKEN = "s3cr3t-token-value"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
