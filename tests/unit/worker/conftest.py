"""Fixtures shared by the worker's middleware tests (auth, admission, observation, sequence)."""

from __future__ import annotations

from pathlib import Path

import pytest
from control_token import TOKEN

from rolloutfleet_worker import auth


@pytest.fixture
def token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The control token in a file, as the mounted Secret holds it, named to the middleware by its variable."""
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(f))
    return f
