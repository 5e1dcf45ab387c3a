"""The validating admission webhook, called the way the API server calls it.

The emulator has no admission chain, so these tests POST AdmissionReview v1 bodies over HTTPS
(the operator's self-signed CA verified; the serving cert names the Service, not 127.0.0.1, so
only the hostname check is off) to kopf's webhook server in the running operator, and check
the verdict and that refusals carry exactly the messages ``kvpool-operator validate`` prints.
"""

from __future__ import annotations

import base64
import copy
import socket
import ssl
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from apiserver import ApiServer
from harness import Client, OperatorThread, eventually, example, test_settings
from test_reconcile import P2PGS, POOLS, observed

from kvpool.operator.loader import load_text
from kvpool.operator.validation import errors, validate_domain

Obj = dict[str, Any]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
async def webhook(
    apiserver: ApiServer, client: Client, tmp_path: Path
) -> AsyncIterator[tuple[OperatorThread, str, ssl.SSLContext]]:
    port = _free_port()
    settings = test_settings(
        webhook_mode="self-signed",
        webhook_host="127.0.0.1",
        webhook_port=port,
        webhook_cert_dir=str(tmp_path / "certs"),
        webhook_namespace="kvpool-system",
    )
    op = OperatorThread(str(apiserver.url), settings).start()
    await op.wait_ready()
    await eventually(lambda: _listening(port), what="the webhook server")
    ctx = ssl.create_default_context(cafile=str(tmp_path / "certs" / "ca.crt"))
    ctx.check_hostname = False
    yield op, f"https://127.0.0.1:{port}", ctx
    await op.stop()


def review(operation: str, obj: Obj | None, old: Obj | None = None) -> Obj:
    subject = obj or old or {}
    plural = {"KVCachePool": "kvcachepools", "P2PGroup": "p2pgroups", "PDPair": "pdpairs"}
    gvk = {"group": "kvpool.io", "version": "v1alpha1", "kind": subject["kind"]}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": gvk,
            "resource": {
                "group": "kvpool.io",
                "version": "v1alpha1",
                "resource": plural[subject["kind"]],
            },
            "requestKind": gvk,
            "name": subject["metadata"]["name"],
            "namespace": "default",
            "operation": operation,
            "userInfo": {"username": "kubernetes-admin"},
            "object": obj,
            "oldObject": old,
            "dryRun": False,
        },
    }


async def ask(url: str, ctx: ssl.SSLContext, path: str, body: Obj) -> Obj:
    async with aiohttp.ClientSession() as http, http.post(f"{url}{path}", json=body, ssl=ctx) as r:
        assert r.status == 200, await r.text()
        answer: Obj = (await r.json())["response"]
        assert answer["uid"] == body["request"]["uid"]
        return answer


def with_ns(doc: Obj) -> Obj:
    out = copy.deepcopy(doc)
    out["metadata"]["namespace"] = "default"
    return out


async def test_valid_member_is_allowed_and_a_bad_one_refused_with_the_cli_messages(
    apiserver: ApiServer, client: Client, webhook: tuple[OperatorThread, str, ssl.SSLContext]
) -> None:
    _, url, ctx = webhook
    demo_pool, demo_p2p, _ = example("cpu-demo")
    bad_pool, bad_p2p = (with_ns(d) for d in example("invalid/p2p-mistakes"))
    del bad_pool["spec"]["tiers"]["disk"]
    await client.create(demo_pool)
    await client.create(bad_pool)
    await eventually(
        lambda: observed(apiserver, POOLS, "demo") and observed(apiserver, POOLS, "pool")
    )

    allowed = await ask(url, ctx, "/validate-p2pgroup", review("CREATE", with_ns(demo_p2p)))
    assert allowed["allowed"] is True

    refused = await ask(url, ctx, "/validate-p2pgroup", review("CREATE", bad_p2p))
    assert refused["allowed"] is False
    assert refused["status"]["code"] == 422
    loaded = load_text(yaml.safe_dump_all([bad_pool, bad_p2p]), "x")
    expected = errors(validate_domain(loaded.pools[0], loaded.members))
    assert expected and refused["status"]["message"] == "\n".join(str(p) for p in expected)


async def test_member_without_pool_is_allowed_with_a_warning_and_bad_yaml_refused(
    apiserver: ApiServer, client: Client, webhook: tuple[OperatorThread, str, ssl.SSLContext]
) -> None:
    _, url, ctx = webhook
    _, p2p, _ = example("cpu-demo")
    answer = await ask(url, ctx, "/validate-p2pgroup", review("CREATE", with_ns(p2p)))
    assert answer["allowed"] is True
    assert any("does not exist" in w for w in answer.get("warnings", []))
    typo = with_ns(p2p)
    typo["spec"]["replicaz"] = 2
    answer = await ask(url, ctx, "/validate-p2pgroup", review("CREATE", typo))
    assert answer["allowed"] is False
    assert "spec.replicaz: Extra inputs are not permitted" in answer["status"]["message"]


async def test_an_edit_that_fixes_a_broken_domain_is_allowed_and_pool_delete_refused(
    apiserver: ApiServer, client: Client, webhook: tuple[OperatorThread, str, ssl.SSLContext]
) -> None:
    _, url, ctx = webhook
    pool, p2p, _ = example("cpu-demo")
    await client.create(pool)
    await client.create(p2p)
    await eventually(lambda: observed(apiserver, P2PGS, "demo-p2p"))
    stored = with_ns(p2p)
    worse = copy.deepcopy(stored)
    worse["spec"]["ports"] = {
        "instances": [{"http": 1, "workerPorts": [], "initPorts": [], "lookupPorts": []}]
    }
    answer = await ask(url, ctx, "/validate-p2pgroup", review("UPDATE", worse, stored))
    assert answer["allowed"] is False
    fixed = await ask(url, ctx, "/validate-p2pgroup", review("UPDATE", stored, worse))
    assert fixed["allowed"] is True
    delete = await ask(url, ctx, "/validate-kvcachepool", review("DELETE", None, with_ns(pool)))
    assert delete["allowed"] is False
    assert "P2PGroup/demo-p2p" in delete["status"]["message"]


async def test_self_signed_mode_writes_the_ca_into_the_webhook_configuration(
    apiserver: ApiServer, webhook: tuple[OperatorThread, str, ssl.SSLContext], tmp_path: Path
) -> None:
    configs = await eventually(
        lambda: [
            c
            for c in apiserver.live(
                "admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
            )
            if c.get("webhooks")
        ]
    )
    (config,) = configs
    assert config["metadata"]["name"] == "kvpool.io"
    hooks = {h["clientConfig"]["service"]["path"]: h for h in config["webhooks"]}
    assert sorted(hooks) == ["/validate-kvcachepool", "/validate-p2pgroup", "/validate-pdpair"]
    client_config = hooks["/validate-p2pgroup"]["clientConfig"]
    assert client_config["service"]["namespace"] == "kvpool-system"
    ca = (tmp_path / "certs" / "ca.crt").read_bytes()
    assert base64.b64decode(client_config["caBundle"]) == ca


async def test_a_sim_engine_in_a_pd_pair_is_refused_with_the_sim_message(
    apiserver: ApiServer, client: Client, webhook: tuple[OperatorThread, str, ssl.SSLContext]
) -> None:
    """engine.sim is validated at `kubectl apply` like every other field: PD transfers are
    not simulated, and the answer names the field and the fix."""
    _, url, ctx = webhook
    pool, _, pair = example("cpu-demo")
    await client.create(pool)
    await eventually(lambda: observed(apiserver, POOLS, "demo"))
    sim_pair = with_ns(pair)
    sim_pair["spec"]["decode"]["engine"]["sim"] = {"profile": "h100-llama-3.1-8b-vllm"}
    answer = await ask(url, ctx, "/validate-pdpair", review("CREATE", sim_pair))
    assert answer["allowed"] is False
    message = answer["status"]["message"]
    assert "PDPair/demo-pd: spec.decode.engine.sim: PD transfers are not simulated" in message
    assert "fix: remove decode.engine.sim" in message
    allowed = await ask(url, ctx, "/validate-pdpair", review("CREATE", with_ns(pair)))
    assert allowed["allowed"] is True
