"""The trainer commands' pure parts: durations, wait targets, the status table; and exit codes."""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest
from trainer_fakes import FakeCustomObjects, fleet, revision

from rolloutfleet import cli
from rolloutfleet.trainer import publish
from rolloutfleet.trainer.cli import UsageError, parse_duration
from rolloutfleet.trainer.cli import publish as publish_cmd
from rolloutfleet.trainer.cli import status as status_cmd
from rolloutfleet.trainer.cli import wait as wait_cmd
from rolloutfleet.trainer.cli.wait import parse_target

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("90s", 90), ("30m", 1800), ("1h30m", 5400), ("1.5h", 5400), ("0.5", 0.5)]
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "10x", "-5", "0", "m"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(UsageError):
        parse_duration(text)


def test_parse_target() -> None:
    assert parse_target("wrev/pol-r3") == "pol-r3"
    assert parse_target("weightrevision.rolloutfleet.io/x") == "x"
    assert parse_target("pol-r3") == "pol-r3"
    for bad in ("pods/x", "wrev/", "wrev/a/b"):
        with pytest.raises(UsageError):
            parse_target(bad)


def _fleet_with_pods() -> dict[str, Any]:
    obj = fleet("pol", "/w")
    obj["metadata"]["namespace"] = "ns"
    obj["status"] = {
        "readyReplicas": 2,
        "currentRevision": 2,
        "targetRevision": 3,
        "conditions": [{"type": "Available", "status": "True"}],
        "pods": [
            {
                "name": "pol-0",
                "ip": "127.1.0.2",
                "ready": True,
                "revision": 2,
                "draftRevision": 2,
                "weightVersion": "2",
            },
            {
                "name": "pol-1",
                "ip": "127.1.0.3",
                "ready": False,
                "revision": 1,
                "draftRevision": 1,
                "step": "LoadVerifier",
                "weightVersion": "1",
            },
        ],
    }
    return obj


def test_render_status_table() -> None:
    revs = [
        revision("pol-r1", "pol", 1, "/w/policy/1"),
        revision("pol-r2", "pol", 2, "/w/policy/2"),
        revision("pol-r3", "pol", 3, "/w/policy/3", phase="Progressing"),
        revision("other-r9", "other", 9, "/w/x"),
    ]
    revs[0]["status"]["completionTime"] = "2026-01-01T10:00:00Z"
    revs[1]["status"]["completionTime"] = "2026-01-01T11:59:30Z"
    revs[2]["metadata"]["creationTimestamp"] = "2026-01-01T11:59:50Z"
    revs[2]["status"]["updated"] = "1/2"
    text = status_cmd.render(_fleet_with_pods(), revs, NOW)
    lines = text.splitlines()
    assert lines[0] == "RolloutFleet ns/pol: 2/2 ready, current revision 2, target 3, Available True"
    assert lines[1] == "Latest WeightRevision pol-r3 (revision 3): Progressing 1/2, age 10s"
    header = lines[3].split()
    assert header == ["POD", "IP", "READY", "VERIFIER", "DRAFT", "STEP", "WEIGHT-VERSION", "REVISION-AGE"]
    assert lines[4].split() == ["pol-0", "127.1.0.2", "yes", "2", "2", "-", "2", "30s"]
    assert lines[5].split() == ["pol-1", "127.1.0.3", "no", "1", "1", "LoadVerifier", "1", "2h"]


def test_render_a_large_fleet_shows_its_pods_unlike_the_rest_then_one_row_for_the_others() -> None:
    """Above 256 pods the status lists only the pods unlike the fleet's most common state and names that state in
    podsCommon (``planning.fleet_status.listing``): the table must still account for every pod."""
    obj = _fleet_with_pods()
    obj["status"]["pods"] = obj["status"]["pods"][1:]
    obj["status"]["podsCommon"] = {"pods": 299, "phase": "Running", "ready": True, "revision": 2, "draftRevision": 2}
    obj["status"]["podsCommon"]["weightVersion"] = "2"
    obj["status"]["podsTruncated"] = 3
    revs = [revision("pol-r2", "pol", 2, "/w/policy/2")]
    revs[0]["status"]["completionTime"] = "2026-01-01T11:59:30Z"
    lines = status_cmd.render(obj, revs, NOW).splitlines()
    assert lines[3].split()[0] == "POD"
    assert lines[4].split()[:6] == ["pol-1", "127.1.0.3", "no", "1", "1", "LoadVerifier"]
    assert lines[5].split() == ["(299", "other", "pods)", "-", "yes", "2", "2", "-", "2", "30s"]
    assert lines[6] == "(3 more pods differ from the other pods but are not listed: the status lists at most 256)"


def test_render_initial_fleet_without_pods() -> None:
    obj = fleet("pol", "/w")
    obj["metadata"]["namespace"] = "ns"
    text = status_cmd.render(obj, [], NOW)
    assert "current revision initial" in text and "(no pods observed yet)" in text


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCustomObjects:
    fake = FakeCustomObjects()
    fake.add("rolloutfleets", "ns", _fleet_with_pods())
    monkeypatch.setattr(publish, "custom_objects_api", lambda _api: fake)
    # Each command module holds its own reference (imported before patching, so undo restores the real one).
    for mod in (publish_cmd, status_cmd, wait_cmd):
        monkeypatch.setattr(mod, "api_client_of", lambda args: _Closable())
    return fake


class _Closable:
    def close(self) -> None:
        pass


def test_commands_exit_codes(fake: FakeCustomObjects, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "pol", "-n", "ns"]) == 0
    assert "pol-1" in capsys.readouterr().out
    assert cli.main(["status", "pol", "-n", "ns", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pods"][0]["weightVersion"] == "2" and "otherPods" not in out
    # A large fleet's JSON names the state of the pods its status does not list, and how many it had no room for.
    fake.objects[("rolloutfleets", "ns", "pol")]["status"].update(
        podsCommon={"pods": 300, "revision": 2}, podsTruncated=4
    )
    assert cli.main(["status", "pol", "-n", "ns", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["otherPods"]["pods"], out["otherPods"]["revision"], out["podsNotListed"]) == (300, 2, 4)
    assert cli.main(["status", "nope", "-n", "ns"]) == 1
    assert "RolloutFleet ns/nope not found" in capsys.readouterr().err
    assert cli.main(["wait", "pods/x", "-n", "ns"]) == 2
    assert cli.main(["wait", "wrev/x", "-n", "ns", "--timeout", "soon"]) == 2
    assert "invalid duration 'soon'" in capsys.readouterr().err
    fake.add("weightrevisions", "ns", revision("pol-r2", "pol", 2, "/w/policy/2", phase="Failed"))
    fake.objects[("weightrevisions", "ns", "pol-r2")]["status"].update(reason="InvalidSpec", message="bad path")
    assert cli.main(["wait", "wrev/pol-r9", "-n", "ns", "-q"]) == 1
    assert capsys.readouterr().err == "rolloutfleet wait: WeightRevision ns/pol-r9 not found\n"
    assert cli.main(["wait", "wrev/pol-r2", "-n", "ns", "-q"]) == 1
    assert "pol-r2 Failed (InvalidSpec): bad path" in capsys.readouterr().err
    assert cli.main(["publish", "pol", "3", "--verifier", "/nowhere/v", "-n", "ns", "-q"]) == 1
    assert "spec.draft: is required" in capsys.readouterr().err
    argv = ["publish", "pol", "3", "--verifier", "/w/policy/v", "--draft", "/w/policy/d", "-n", "ns", "-q"]
    assert cli.main(argv) == 1
    assert capsys.readouterr().err == "rolloutfleet publish: verifier checkpoint /w/policy/v: not a directory\n"
    assert fake.creates == []
    with pytest.raises(SystemExit) as info:
        cli.main(["publish", "pol", "three", "--verifier", "/v"])
    assert info.value.code == 2
