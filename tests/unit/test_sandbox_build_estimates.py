"""The build's progress estimate (issue "first run"): a tool's last build here, else the reference cold
build on 2 cores, else none; every build records its own time for the next one.

Pure file handling in a temporary cache root: nothing is built.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from rolloutfleet.sandbox import binaries

pytestmark = pytest.mark.unit


@pytest.fixture
def cache(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    monkeypatch.setenv("ROLLOUTFLEET_CACHE", str(tmp_path))
    return tmp_path


def test_the_estimate_is_the_last_build_here_else_the_reference(
    cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    etcd = binaries.TOOLS["etcd"]
    monkeypatch.setattr(binaries, "REFERENCE_SECONDS", {"etcd": 250.0})
    assert binaries._expected_seconds(etcd) == (250.0, "a cold build on 2 cores")
    binaries.record_seconds(etcd, 123.4)
    assert binaries._expected_seconds(etcd) == (123.4, "its last build here")
    recorded = json.loads((cache / "build-times.json").read_text())
    assert recorded == {f"etcd-{etcd.version}": 123.4}
    monkeypatch.setattr(binaries, "REFERENCE_SECONDS", {})
    assert binaries._expected_seconds(binaries.TOOLS["helm"]) is None


def test_a_damaged_timings_file_is_ignored_and_replaced(cache: pathlib.Path) -> None:
    (cache / "build-times.json").write_text("not json")
    kwok = binaries.TOOLS["kwok"]
    binaries.record_seconds(kwok, 10.0)
    assert binaries._expected_seconds(kwok) == (10.0, "its last build here")


def test_a_complete_cache_needs_no_go(cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine given the cache (the device bench: no Go there) runs the control plane; one missing a
    binary is told which one Go would have to build."""
    monkeypatch.setenv("PATH", str(cache / "no-go-here"))
    kwok = binaries.TOOLS["kwok"]
    binaries.binary_path("kwok").parent.mkdir(parents=True)
    binaries.binary_path("kwok").write_bytes(b"")
    with pytest.raises(binaries.BuildError, match="needed to build kwok"):
        binaries.ensure(["kwok"])
    for asset, _ in kwok.assets:
        binaries.asset_path("kwok", asset).write_text("")
    assert binaries.ensure(["kwok"]) == {"kwok": binaries.binary_path("kwok")}
