"""Who may change the controller: the API token on its mutating routes, and the allowlist of
instance ids that may register (allowlist.py, auth.py).

Every route of the app is classified here (mutating or read-only), so a new route fails this
test until it is; each mutating route answers 401 without the token and with a wrong one, and
runs with it; the read-only ones stay open. Mutating orchestration over ZMQ is refused while a
token is configured. Registrations of ids outside the allowlist are refused, counted (metrics,
``/v1/stats``) and logged by id; a pushed or re-read allowlist lets the next heartbeat in.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from kvpool.controller import auth
from kvpool.controller.allowlist import Allowlist, AllowlistError, AllowlistFile
from kvpool.controller.api import create_app
from kvpool.controller.main import main
from kvpool.controller.orchestration import OPERATIONS, handle_zmq_orchestration
from kvpool.controller.server import ControllerServer
from kvpool.controller.settings import ControllerSettings
from kvpool.protocol import lmcache_wire as p

TOKEN = "s3cret-token-of-the-domain-0123456789"
#: Every route that changes state, with a body it accepts.
MUTATING: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/clear"): {"instance_id": "a~0123456789ab", "location": "LocalCPUBackend"},
    ("POST", "/pin"): {"instance_id": "a~0123456789ab", "location": "L", "tokens": [1]},
    ("POST", "/compress"): {"instance_id": "a~0123456789ab", "method": "cachegen", "location": "L"},
    ("POST", "/decompress"): {
        "instance_id": "a~0123456789ab",
        "method": "cachegen",
        "location": "L",
    },
    ("POST", "/move"): {"old_position": ["a~0123456789ab", "L"], "new_position": ["b", "L"]},
    ("POST", "/v1/deregister"): {"instance_id": "a~0123456789ab"},
    ("PUT", "/v1/instances"): {"instance_ids": ["a~0123456789ab"]},
}
#: Every read-only route, with a body it accepts (None: GET).
READ_ONLY: dict[tuple[str, str], dict[str, Any] | None] = {
    ("POST", "/lookup"): {"tokens": [1, 2]},
    ("POST", "/query_instance"): {"ip": "10.0.0.1"},
    ("POST", "/query_worker_info"): {"instance_id": "all"},
    ("POST", "/health"): {"instance_id": "a~0123456789ab"},
    ("POST", "/check_finish"): {"event_id": "e"},
    ("POST", "/v1/prefix_lookup"): {"hashes": [1]},
    ("GET", "/v1/stats"): None,
    ("GET", "/v1/instances"): None,
    ("GET", "/"): None,
    ("GET", "/metrics"): None,
    ("GET", "/healthz"): None,
    ("GET", "/readyz"): None,
}


def settings(**kw: Any) -> ControllerSettings:
    return ControllerSettings(host="127.0.0.1", monitor_ports={"pull": 0}, **kw)


@pytest.fixture
async def guarded() -> AsyncIterator[ControllerServer]:
    srv = ControllerServer(settings(api_token=SecretStr(TOKEN), fingerprint="0123456789ab"))
    yield srv
    await srv.close()


def client(server: ControllerServer) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=create_app(server))
    return httpx.AsyncClient(transport=transport, base_url="http://t")


async def call(c: httpx.AsyncClient, route: tuple[str, str], body: Any, **kw: Any) -> Any:
    method, path = route
    return await c.request(method, path, json=body, **kw)


def test_every_route_is_classified() -> None:
    """A new route must be listed as mutating or read-only here (and guarded if mutating)."""
    app = create_app(ControllerServer(settings()))
    routes = {
        (method, path)
        for path, item in app.openapi()["paths"].items()
        for method in (m.upper() for m in item)
    }
    assert routes == set(MUTATING) | set(READ_ONLY)
    assert {op.path for op in OPERATIONS if op.mutates} == {
        path for method, path in MUTATING if method == "POST" and not path.startswith("/v1/")
    }


@pytest.mark.parametrize("route", sorted(MUTATING), ids=lambda r: r[1])
async def test_a_mutating_route_wants_the_token(
    guarded: ControllerServer, route: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    body = MUTATING[route]
    async with client(guarded) as c:
        missing = await call(c, route, body)
        wrong = await call(c, route, body, headers={"Authorization": f"Bearer {TOKEN}x"})
        basic = await call(c, route, body, headers={"Authorization": f"Basic {TOKEN}"})
        right = await call(c, route, body, headers={"Authorization": f"Bearer {TOKEN}"})
        lower = await call(c, route, body, headers={"authorization": f"bearer  {TOKEN} "})
    for refused in (missing, wrong, basic):
        assert refused.status_code == 401, refused.text
        assert "'Authorization: Bearer <token>'" in refused.json()["detail"]
        assert route[1] in refused.json()["detail"]
        assert refused.headers["www-authenticate"].startswith("Bearer")
    # with the token the route runs (a 500 names the unknown instance: no worker is registered)
    assert right.status_code in (200, 500), right.text
    assert lower.status_code == right.status_code
    assert guarded.service.metrics.unauthorized[route[1]] == 3
    assert f'kvpool_controller_unauthorized_total{{path="{route[1]}"}} 3.0' in (
        guarded.service.metrics.render().decode()
    )
    logged = [r.getMessage() for r in caplog.records]
    assert sum("missing or wrong bearer token" in m for m in logged) == 1  # once per route
    assert not [m for m in logged if TOKEN in m]


async def test_a_bad_body_without_the_token_is_a_401_not_a_422(
    guarded: ControllerServer,
) -> None:
    async with client(guarded) as c:
        r = await c.post("/clear", json={"nonsense": True})
    assert r.status_code == 401


@pytest.mark.parametrize("route", sorted(READ_ONLY), ids=lambda r: f"{r[0]} {r[1]}")
async def test_a_read_only_route_stays_open(
    guarded: ControllerServer, route: tuple[str, str]
) -> None:
    async with client(guarded) as c:
        r = await call(c, route, READ_ONLY[route])
    assert r.status_code != 401, r.text


async def test_without_a_token_every_route_is_open_as_before() -> None:
    server = ControllerServer(settings())
    async with client(server) as c:
        r = await c.post("/v1/deregister", json={"instance_id": "a"})
        assert r.status_code == 200 and r.json() == {"instance_id": "a", "deregistered": 0}
        r = await c.put("/v1/instances", json={"instance_ids": ["a"]})
        assert r.json() == {"instance_ids": ["a"], "source": "operator"}
    await server.close()


def test_the_token_is_compared_in_constant_time_and_never_printed() -> None:
    assert auth.authorized(None, None)
    assert auth.authorized("t", "Bearer t") and auth.authorized("t", "  BEARER   t ")
    for header in (None, "", "Bearer", "Bearer ", "t", "Basic t", "Bearer tt", "Bearer T"):
        assert not auth.authorized("t", header), header
    s = settings(api_token=SecretStr(TOKEN))
    assert TOKEN not in repr(s) and TOKEN not in str(s.model_dump())
    assert settings(api_token=SecretStr("")).api_token is None  # an empty Secret: no token
    assert "hmac.compare_digest" in Path(auth.__file__).read_text()


async def test_mutating_orchestration_over_zmq_is_refused_while_a_token_is_set(
    guarded: ControllerServer,
) -> None:
    svc = guarded.service
    refused = await handle_zmq_orchestration(svc, p.ClearMsg("e1", "a~0123456789ab", "L"))
    assert isinstance(refused, p.ErrorMsg) and "POST /clear" in refused.error
    assert svc.metrics.bad_input["unauthorized_orchestration"] == 1
    answered = await handle_zmq_orchestration(svc, p.QueryInstMsg("e2", "10.0.0.9"))
    assert isinstance(answered, p.QueryInstRetMsg)
    open_server = ControllerServer(settings())
    ran = await handle_zmq_orchestration(open_server.service, p.ClearMsg("e3", "ghost", "L"))
    assert isinstance(ran, p.ErrorMsg) and "ghost" in ran.error  # it ran: no worker to clear
    await open_server.close()


async def test_an_unknown_instance_is_refused_counted_and_logged_until_allowed(
    guarded: ControllerServer, caplog: pytest.LogCaptureFixture
) -> None:
    svc = guarded.service
    svc.allowlist.replace(["a~0123456789ab"], "file")
    reply = svc.handle_request(p.RegisterMsg("a~0123456789ab", 0, "10.0.0.1", 7000, None))
    assert isinstance(reply, p.RegisterRetMsg)
    stranger = "z~0123456789ab"
    for _ in range(2):  # its registration, then its heartbeat's re-registration
        reply = svc.handle_request(p.RegisterMsg(stranger, 0, "10.0.0.2", 7000, None))
        assert isinstance(reply, p.ErrorMsg) and "not one the operator rendered" in reply.error
    beat = svc.handle_request(p.HeartbeatMsg(stranger, 0, "10.0.0.2", 7000, None))
    assert isinstance(beat, p.ErrorMsg)
    svc.handle_push(p.RegisterMsg(stranger, 1, "10.0.0.2", 7001, None))  # the PUSH path too
    assert svc.registry.instances() == ["a~0123456789ab"]
    assert svc.metrics.refusals == {"fingerprint": 0, "unknown_instance": 4}
    text = svc.metrics.render().decode()
    assert 'kvpool_controller_refusals_total{reason="unknown_instance"} 4.0' in text
    async with client(guarded) as c:
        stats = (await c.get("/v1/stats")).json()
        assert stats["refusals"] == {"fingerprint": 0, "unknown_instance": 4}
        assert "not one the operator rendered" in stats["refused"][stranger]
        # the operator allows it (a scale-up): the next heartbeat registers it
        allowed = [stranger, "a~0123456789ab"]
        r = await c.put(
            "/v1/instances",
            json={"instance_ids": allowed},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.json() == {"instance_ids": sorted(allowed), "source": "operator"}
        beat = svc.handle_request(p.HeartbeatMsg(stranger, 0, "10.0.0.2", 7000, None))
        assert isinstance(beat, p.HeartbeatRetMsg)
        assert sorted(svc.registry.instances()) == sorted(allowed)
        assert stranger not in (await c.get("/v1/stats")).json()["refused"]
        assert (await c.get("/v1/instances")).json()["source"] == "operator"
    refusals = [r.getMessage() for r in caplog.records if "refusing instance" in r.getMessage()]
    assert refusals == [f"refusing instance {stranger}: {stats['refused'][stranger]}"]


async def test_another_fingerprint_is_still_refused_as_such(guarded: ControllerServer) -> None:
    guarded.service.allowlist.replace(["a~ffffffffffff"], "operator")
    reply = guarded.service.register("a~ffffffffffff", 0, "10.0.0.1", 7000, None)
    assert reply is not None and "fingerprint mismatch" in reply
    assert guarded.service.metrics.refusals["fingerprint"] == 1


def test_without_an_allowlist_every_id_may_register() -> None:
    assert Allowlist().allows("anything") and Allowlist().describe()["instance_ids"] is None
    server = ControllerServer(settings())
    assert server.service.register("free-form-id", 0, "10.0.0.1", 7000, None) is None


async def test_the_file_is_read_at_start_and_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "instances.yaml"
    path.write_text("instance_ids:\n- a~0123456789ab\n")
    server = ControllerServer(settings(instances_file=str(path)))
    svc, file = server.service, server.allowlist_file
    assert file is not None and svc.allowlist.describe() == {
        "instance_ids": ["a~0123456789ab"],
        "source": "file",
    }
    assert not file.poll(svc.allowlist)  # unchanged: a push since is not overwritten
    svc.allowlist.replace(["a~0123456789ab", "b~0123456789ab"], "operator")
    assert not file.poll(svc.allowlist) and svc.allowlist.source == "operator"
    path.write_text('{"instance_ids": ["c~0123456789ab"]}')  # JSON is YAML too
    assert file.poll(svc.allowlist)
    assert svc.allowlist.ids == frozenset({"c~0123456789ab"})
    path.write_text("instance_ids: 7")  # malformed later: the list is kept
    assert not file.poll(svc.allowlist) and svc.allowlist.ids == frozenset({"c~0123456789ab"})
    await server.close()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (None, "cannot read it"),
        ("instance_ids: [", "not JSON or YAML"),
        ("instances: []", "'instance_ids' must be a list of instance ids"),
        ("instance_ids: ['']", "'instance_ids' must be a list of instance ids"),
    ],
)
def test_a_bad_file_at_start_is_an_error_naming_it(
    tmp_path: Path, text: str | None, error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "instances.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(AllowlistError, match=error):
        AllowlistFile(str(path)).load(Allowlist())
    with pytest.raises(SystemExit) as exit_:
        main(
            ["--host", "127.0.0.1", "--monitor-ports", '{"pull": 0}', "--instances-file", str(path)]
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--instances-file {path}" in err and error.split("'")[0] in err


def test_refused_ids_are_bounded_oldest_first() -> None:
    """A stranger registering ever new ids keeps at most REFUSED_KEPT of them (the latest),
    while every refusal is still counted."""
    from kvpool.controller import service as service_module

    server = ControllerServer(ControllerSettings())
    svc = server.service
    svc.allowlist.replace(["a~0123456789ab"], "file")
    extra = 10
    ids = [f"z{i}~0123456789ab" for i in range(service_module.REFUSED_KEPT + extra)]
    for iid in ids:
        assert isinstance(
            svc.handle_request(p.RegisterMsg(iid, 0, "10.0.0.2", 1, None)), p.ErrorMsg
        )
    kept = list(svc.refused)
    assert len(kept) == service_module.REFUSED_KEPT
    assert kept == ids[extra:]
    assert svc.metrics.refusals["unknown_instance"] == len(ids)
