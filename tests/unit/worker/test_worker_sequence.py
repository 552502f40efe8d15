"""``POST /rolloutfleet/sequence`` of ControlAuthMiddleware on a real Starlette app shaped like vLLM's routes.

Why it exists (issues 17 and 18): inside an AllAtOnce pause every request round is time the whole fleet is
out of service, and every request costs the operator CPU per pod. The route runs a step's calls (a resume's
version stamp, KV wake, prefix-cache reset and resume; a staged commit of both targets) in one request. What
it must never do: run a call after one that failed (a refused verifier commit must stop the draft's), run
anything on another process or on weights the operator did not see (the guard replaces the read before a
resume), or reach anything without the token. The same behaviour is held against real vLLM and the simulator
by the contract suite (tests/contract).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from control_token import AUTH
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rolloutfleet_worker import auth, observation, sequence

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("token_file")]

STATE = {"ok": True, "rank": 0, "resident": True, "verifier": {"revision": 2, "digest": "blake3:v2", "path": "/w"}}


class FakeVllm:
    """The dev routes a sequence calls; records every call that reached it (path, query, token, body)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None, Any]] = []
        self.state: dict[str, Any] = dict(STATE, draft=None, session=None)
        self.commit_fails: set[str] = set()
        self.paused = False

    async def _note(self, request: Request) -> Any:
        body = await request.json() if request.method == "POST" and await request.body() else None
        self.seen.append((request.url.path, request.url.query, request.headers.get("authorization"), body))
        return body

    async def simple(self, request: Request) -> Response:
        await self._note(request)
        if request.url.path == "/reset_prefix_cache":
            return JSONResponse({"success": True})
        if request.url.path == "/pause" and request.query_params.get("mode") not in ("keep", "wait", "abort"):
            return JSONResponse({"error": "invalid pause mode"}, status_code=400)
        if request.url.path == "/pause":
            self.paused = True
        return JSONResponse({"status": "ok"})

    async def collective_rpc(self, request: Request) -> Response:
        body = await self._note(request)
        if body["method"] == "rolloutfleet_state":
            return JSONResponse({"results": [self.state]})
        if body["method"] == "rolloutfleet_load":
            target = body["kwargs"]["target"]
            if target in self.commit_fails:
                error = {"code": "staged_mismatch", "message": "the staged bytes changed"}
                return JSONResponse({"results": [{"ok": False, "error": error}]})
            return JSONResponse({"results": [{"ok": True, "target": target}]})
        return PlainTextResponse("Internal Server Error", status_code=500)

    async def is_paused(self, request: Request) -> Response:
        await self._note(request)
        return JSONResponse({"is_paused": self.paused})

    def app(self) -> Starlette:
        routes = [
            Route(p, self.simple, methods=["POST"]) for p in ("/pause", "/resume", "/wake_up", "/reset_prefix_cache")
        ]
        routes.append(Route("/collective_rpc", self.collective_rpc, methods=["POST"]))
        routes.append(Route("/is_paused", self.is_paused, methods=["GET"]))
        app = Starlette(routes=routes)
        app.add_middleware(auth.ControlAuthMiddleware)  # what vLLM's --middleware does
        return app


@pytest.fixture
async def engine() -> AsyncIterator[tuple[FakeVllm, httpx.AsyncClient]]:
    vllm = FakeVllm()
    transport = httpx.ASGITransport(app=vllm.app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        yield vllm, client


RESUME = [
    {"path": "/wake_up", "query": "tags=kv_cache"},
    {"path": "/reset_prefix_cache", "query": "reset_running_requests=true"},
    {"path": "/resume"},
]


def _commit(target: str) -> dict[str, Any]:
    kwargs = {"target": target, "path": f"/w/{target}", "revision": 2, "staged": True}
    return {"path": "/collective_rpc", "json": {"method": "rolloutfleet_load", "args": [], "kwargs": kwargs}}


async def _instance(client: httpx.AsyncClient) -> str:
    return str((await client.get("/rolloutfleet/ready")).json()["instance"])


async def test_the_calls_run_in_order_each_answered_as_on_its_own(engine: tuple[FakeVllm, httpx.AsyncClient]) -> None:
    vllm, client = engine
    r = await client.post(sequence.SEQUENCE_PATH, headers=AUTH, json={"calls": RESUME})
    assert r.status_code == 200
    body = r.json()
    assert body["held"] is None and "state" not in body
    # Each call answered as on its own, and timed apart (the operator records a chain's steps from these).
    assert [{k: p[k] for k in ("status", "body")} for p in body["results"]] == [
        {"status": 200, "body": {"status": "ok"}},
        {"status": 200, "body": {"success": True}},
        {"status": 200, "body": {"status": "ok"}},
    ]
    assert all(isinstance(p["seconds"], float) and 0 <= p["seconds"] < 5 for p in body["results"])
    # In order, with their queries, and with the caller's token (vLLM's own checks see what was sent).
    assert [(p, q) for p, q, _, _ in vllm.seen] == [
        ("/wake_up", "tags=kv_cache"),
        ("/reset_prefix_cache", "reset_running_requests=true"),
        ("/resume", ""),
    ]
    assert {h for _, _, h, _ in vllm.seen} == {AUTH["Authorization"]}


async def test_a_failed_call_stops_the_sequence(engine: tuple[FakeVllm, httpx.AsyncClient]) -> None:
    vllm, client = engine
    calls = [{"path": "/pause", "query": "mode=nonsense"}, {"path": "/resume"}]
    body = (await client.post(sequence.SEQUENCE_PATH, headers=AUTH, json={"calls": calls})).json()
    assert [p["status"] for p in body["results"]] == [400]
    assert [p for p, _, _, _ in vllm.seen] == ["/pause"]  # the resume never ran


async def test_a_call_whose_body_does_not_hold_its_expectation_stops_the_sequence(
    engine: tuple[FakeVllm, httpx.AsyncClient],
) -> None:
    """vLLM refuses some things with a 200 (a prefix-cache reset answers ``{"success": false}``): the call's
    ``expect`` makes that a stop, so the resume after a refused reset never runs."""
    vllm, client = engine
    calls = [{"path": "/reset_prefix_cache", "expect": {"success": False}}, {"path": "/resume"}]  # it answers true
    body = (await client.post(sequence.SEQUENCE_PATH, headers=AUTH, json={"calls": calls})).json()
    assert [p["status"] for p in body["results"]] == [200]
    assert [p for p, _, _, _ in vllm.seen] == ["/reset_prefix_cache"]
    calls[0]["expect"] = {"success": True}
    body = (await client.post(sequence.SEQUENCE_PATH, headers=AUTH, json={"calls": calls})).json()
    assert len(body["results"]) == 2


async def test_stop_false_runs_every_call_whatever_the_others_answered(
    engine: tuple[FakeVllm, httpx.AsyncClient],
) -> None:
    """For calls that change nothing (the pre-flights of both targets): the draft's answer is wanted even when
    the verifier's is a refusal."""
    vllm, client = engine
    vllm.commit_fails.add("verifier")
    calls = [_commit("verifier"), _commit("draft")]
    body = (await client.post(sequence.SEQUENCE_PATH, headers=AUTH, json={"calls": calls, "stop": False})).json()
    assert [p["body"]["results"][0]["ok"] for p in body["results"]] == [False, True]


async def test_a_refused_verifier_commit_never_lets_the_draft_commit(
    engine: tuple[FakeVllm, httpx.AsyncClient],
) -> None:
    """The draft follows only a verifier whose landed bytes hashed to the verified stage (an RPC answers 200
    with ``ok: false`` on the rank that refused: that ends the sequence too)."""
    vllm, client = engine
    vllm.commit_fails.add("verifier")
    body = (
        await client.post(sequence.SEQUENCE_PATH, headers=AUTH, json={"calls": [_commit("verifier"), _commit("draft")]})
    ).json()
    assert len(body["results"]) == 1 and body["results"][0]["body"]["results"][0]["ok"] is False
    assert [b["kwargs"]["target"] for p, _, _, b in vllm.seen if p == "/collective_rpc"] == ["verifier"]
    vllm.commit_fails.clear()
    body = (
        await client.post(sequence.SEQUENCE_PATH, headers=AUTH, json={"calls": [_commit("verifier"), _commit("draft")]})
    ).json()
    assert [p["body"]["results"][0]["target"] for p in body["results"]] == ["verifier", "draft"]


async def test_the_guard_runs_nothing_on_another_process(engine: tuple[FakeVllm, httpx.AsyncClient]) -> None:
    vllm, client = engine
    body = (
        await client.post(sequence.SEQUENCE_PATH, headers=AUTH, json={"instance": "0" * 16, "calls": RESUME})
    ).json()
    assert body["held"] == "instance" and body["results"] == [] and vllm.seen == []
    assert body["admission"]["instance"] == await _instance(client)


async def test_the_guard_runs_nothing_on_weights_the_operator_did_not_see(
    engine: tuple[FakeVllm, httpx.AsyncClient],
) -> None:
    vllm, client = engine
    instance = await _instance(client)
    expect = {"resident": True, "verifier": {"revision": 2, "digest": "blake3:v2"}, "draft": None, "session": None}
    ok = {"instance": instance, "expect": expect, "calls": RESUME}
    body = (await client.post(sequence.SEQUENCE_PATH, headers=AUTH, json=ok)).json()
    assert body["held"] is None and len(body["results"]) == 3
    assert body["state"]["body"]["results"][0]["verifier"]["revision"] == 2
    for change in (
        {"verifier": {"revision": 2, "digest": "blake3:other", "path": "/w"}},  # other bytes under the revision
        {"resident": False},  # slept, weights discarded
        {"session": {"target": "verifier", "revision": 3, "epoch": 1}},  # a session opened behind our back
    ):
        vllm.seen.clear()
        vllm.state = {**STATE, "draft": None, "session": None, **change}
        body = (await client.post(sequence.SEQUENCE_PATH, headers=AUTH, json=ok)).json()
        assert body["held"] == "state" and body["results"] == [], change
        assert [p for p, _, _, _ in vllm.seen] == ["/collective_rpc"], change  # only the guard's read


async def test_an_observation_among_the_calls_is_answered_as_on_its_own_after_the_calls_before_it(
    engine: tuple[FakeVllm, httpx.AsyncClient],
) -> None:
    """The operator's pre-flight reads the engine in its own request (issue 18): the observation is the last
    call, answered with the body ``GET /rolloutfleet/observe`` answers, and read after the calls before it."""
    vllm, client = engine
    alone = (await client.get(observation.OBSERVE_PATH, headers=AUTH)).json()
    vllm.seen.clear()
    calls = [{"path": "/pause", "query": "mode=keep"}, {"path": observation.OBSERVE_PATH, "method": "GET"}]
    body = (await client.post(sequence.SEQUENCE_PATH, headers=AUTH, json={"calls": calls, "stop": False})).json()
    assert [p["status"] for p in body["results"]] == [200, 200]
    read = body["results"][1]["body"]
    assert read["admission"] == alone["admission"]
    assert read["routes"]["state"] == alone["routes"]["state"]
    assert read["routes"]["is_paused"] == {"status": 200, "body": {"is_paused": True}}  # after the pause
    assert alone["routes"]["is_paused"] == {"status": 200, "body": {"is_paused": False}}
    assert next(p for p, _, _, _ in vllm.seen) == "/pause"  # the pause ran first, the reads after it
    assert {h for _, _, h, _ in vllm.seen} == {AUTH["Authorization"]}


async def test_admission_calls_are_answered_by_the_middleware(engine: tuple[FakeVllm, httpx.AsyncClient]) -> None:
    vllm, client = engine
    await client.post("/rolloutfleet/admit", headers=AUTH, json={"revision": 1})
    calls = [{"path": "/rolloutfleet/withdraw"}, {"path": "/pause", "query": "mode=keep&clear_cache=false"}]
    body = (await client.post(sequence.SEQUENCE_PATH, headers=AUTH, json={"calls": calls})).json()
    withdrawn = {"status": 200, "body": {"admitted": False, "instance": await _instance(client)}}
    assert {k: body["results"][0][k] for k in ("status", "body")} == withdrawn
    assert (await client.get("/rolloutfleet/ready")).status_code == 503
    assert [p for p, _, _, _ in vllm.seen] == ["/pause"]


async def test_the_sequence_needs_the_token_and_reaches_nothing_without_it(
    engine: tuple[FakeVllm, httpx.AsyncClient],
) -> None:
    vllm, client = engine
    r = await client.post(sequence.SEQUENCE_PATH, json={"calls": RESUME})
    assert r.status_code == 401 and vllm.seen == []


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"calls": []}, "calls must be a list"),
        ({"calls": [{"path": "/resume"}] * (sequence.MAX_CALLS + 1)}, "calls must be a list"),
        ({"calls": [{"path": "resume"}]}, "calls[0].path"),
        ({"calls": [{"path": "/resume?x=1"}]}, "calls[0].path"),
        ({"calls": [{"path": "/resume", "method": "DELETE"}]}, "calls[0].method"),
        ({"calls": [{"path": "/rolloutfleet/sequence"}]}, "cannot be part of a sequence"),
        ({"calls": [{"path": "/rolloutfleet/observe"}]}, "is read with GET"),  # POST: the default method
        ({"calls": [{"path": "/rolloutfleet/ready", "method": "GET"}]}, "cannot be part of a sequence"),
        ({"calls": RESUME, "expect": [1]}, "expect must be a JSON object"),
        ({"calls": RESUME, "instance": ""}, "instance must be"),
        ({"calls": [{"path": "/resume", "expect": [True]}]}, "calls[0].expect"),
        ({"calls": RESUME, "stop": "no"}, "stop must be"),
    ],
)
async def test_a_malformed_sequence_runs_nothing(
    engine: tuple[FakeVllm, httpx.AsyncClient], body: dict[str, Any], why: str
) -> None:
    vllm, client = engine
    r = await client.post(sequence.SEQUENCE_PATH, headers=AUTH, json=body)
    assert r.status_code == 400 and why in r.json()["error"]["message"] and vllm.seen == []


def test_holds_compares_objects_key_by_key() -> None:
    assert sequence.holds({"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"c": 2}})
    assert sequence.holds({"a": 1}, {"missing": None})  # a missing key reads as null
    assert not sequence.holds({"a": 1}, {"a": 2})
    assert not sequence.holds({"a": None}, {"a": {"b": 1}})


async def test_an_rpc_call_s_expectation_is_held_by_every_rank_or_the_sequence_ends_there(
    engine: tuple[FakeVllm, httpx.AsyncClient],
) -> None:
    """A Rolling pod's update chains its loads, a ``rolloutfleet_state`` read expecting the revision's digests,
    and the resume (issue 18): the expectation is held by each rank's result, as the guard's is, so the resume
    runs only on weights that verify. Compared with the RPC's whole body (``{"results": [...]}``) it could never
    hold: every chained resume would stop there."""
    vllm, client = engine
    state = {"path": "/collective_rpc", "json": {"method": "rolloutfleet_state", "args": [], "kwargs": {}}}
    right = {**state, "expect": {"verifier": {"revision": 2, "digest": "blake3:v2"}, "session": None}}
    body = (await client.post(sequence.SEQUENCE_PATH, headers=AUTH, json={"calls": [right, *RESUME]})).json()
    assert len(body["results"]) == 4 and vllm.seen[-1][0] == "/resume"
    vllm.seen.clear()
    wrong = {**state, "expect": {"verifier": {"revision": 2, "digest": "blake3:other"}}}
    body = (await client.post(sequence.SEQUENCE_PATH, headers=AUTH, json={"calls": [wrong, *RESUME]})).json()
    assert [p["status"] for p in body["results"]] == [200]
    assert [p for p, _, _, _ in vllm.seen] == ["/collective_rpc"]  # nothing of the resume ran
    assert sequence.failed("/collective_rpc", {"status": 200, "body": {"results": []}}, {"session": None})
