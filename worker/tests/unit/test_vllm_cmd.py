"""The vLLM(-Ascend) command line: connector per platform, kv_role and extras per PD role.

vLLM cannot run on this machine (no GPU or NPU), so the command it would exec is checked here
as data: the JSON vLLM parses, the flags it reads.
"""

from __future__ import annotations

import json

import pytest

from kvpool.worker.vllm_cmd import (
    VllmCommandError,
    VllmLaunch,
    kv_role,
    kv_transfer_config,
    vllm_command,
)

ASCEND = VllmLaunch(model="/models/qwen3", platform="ascend", block_size=128, kv_dtype="bfloat16")
CUDA = VllmLaunch(model="Qwen/Qwen3-8B", platform="cuda", block_size=16, kv_dtype="float16")


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _transfer(argv: list[str]) -> dict[str, object]:
    out = json.loads(_flag(argv, "--kv-transfer-config"))
    assert isinstance(out, dict)
    return out


def test_ascend_uses_the_dynamic_lmcache_ascend_connector() -> None:
    argv = vllm_command({"chunk_size": 256}, ASCEND)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert _transfer(argv) == {
        "kv_connector": "LMCacheAscendConnectorV1Dynamic",
        "kv_role": "kv_both",
        "kv_connector_module_path": "lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1",
    }
    assert _flag(argv, "--block-size") == "128"
    assert _flag(argv, "--dtype") == "bfloat16"
    assert _flag(argv, "--model") == "/models/qwen3" == _flag(argv, "--served-model-name")


def test_ascend_builtin_connector_for_new_vllm_ascend() -> None:
    launch = VllmLaunch(
        model="m",
        platform="ascend",
        block_size=128,
        kv_dtype="bfloat16",
        ascend_connector="builtin",
    )
    assert kv_transfer_config({}, launch) == {
        "kv_connector": "LMCacheAscendConnector",
        "kv_role": "kv_both",
    }


def test_gpu_uses_lmcache_connector_v1() -> None:
    argv = vllm_command({}, CUDA)
    assert _transfer(argv) == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    assert _flag(argv, "--dtype") == "float16"


def test_pd_sender_is_a_producer_that_keeps_partial_chunks() -> None:
    config = {"enable_pd": True, "pd_role": "sender"}
    launch = VllmLaunch(
        model="m", platform="ascend", block_size=128, kv_dtype="bfloat16", lmcache_rpc_port="p0"
    )
    transfer = kv_transfer_config(config, launch)
    assert transfer["kv_role"] == "kv_producer"
    assert transfer["kv_connector_extra_config"] == {
        "discard_partial_chunks": False,
        "lmcache_rpc_port": "p0",
    }


def test_pd_receiver_is_a_consumer_that_skips_the_last_token() -> None:
    transfer = kv_transfer_config({"enable_pd": True, "pd_role": "receiver"}, CUDA)
    assert transfer["kv_role"] == "kv_consumer"
    assert transfer["kv_connector_extra_config"] == {
        "discard_partial_chunks": False,
        "skip_last_n_tokens": 1,
    }


@pytest.mark.parametrize(
    ("config", "role"),
    [
        ({}, "kv_both"),
        ({"enable_pd": False, "pd_role": "sender"}, "kv_both"),
        ({"enable_pd": True, "pd_role": "sender"}, "kv_producer"),
        ({"enable_pd": True, "pd_role": "receiver"}, "kv_consumer"),
    ],
)
def test_kv_role(config: dict[str, object], role: str) -> None:
    assert kv_role(config) == role


def test_pd_without_a_role_is_refused() -> None:
    with pytest.raises(VllmCommandError, match="pd_role"):
        vllm_command({"enable_pd": True}, CUDA)


@pytest.mark.parametrize(
    ("kv_dtype", "vllm"),
    [("fp8_e4m3", "fp8_e4m3"), ("float8_e4m3fn", "fp8_e4m3"), ("float8_e5m2", "fp8_e5m2"),
     ("int8", "int8")],
)  # fmt: skip
def test_8_bit_kv_goes_to_kv_cache_dtype_in_vllms_spelling(kv_dtype: str, vllm: str) -> None:
    """The operator renders torch names (float8_e4m3fn); vLLM's flag only knows fp8_e4m3."""
    launch = VllmLaunch(model="m", platform="cuda", block_size=16, kv_dtype=kv_dtype)
    argv = vllm_command({}, launch)
    assert _flag(argv, "--kv-cache-dtype") == vllm
    assert "--dtype" not in argv


def test_kv_dtype_vllm_does_not_know_is_refused_naming_the_flag() -> None:
    launch = VllmLaunch(model="m", platform="cuda", block_size=16, kv_dtype="float8_e4m3")
    with pytest.raises(VllmCommandError, match=r"--kv-dtype 'float8_e4m3'.*fp8_e4m3"):
        vllm_command({}, launch)


def test_tp_port_name_and_extras_are_passed() -> None:
    launch = VllmLaunch(
        model="m",
        platform="ascend",
        block_size=128,
        kv_dtype="bfloat16",
        tensor_parallel_size=4,
        port=9000,
        served_model_name="qwen",
        max_model_len=32768,
        extra_args=("--enforce-eager", "--gpu-memory-utilization=0.9"),
    )
    argv = vllm_command({}, launch)
    assert _flag(argv, "--tensor-parallel-size") == "4"
    assert _flag(argv, "--port") == "9000"
    assert _flag(argv, "--served-model-name") == "qwen"
    assert _flag(argv, "--max-model-len") == "32768"
    assert argv[-2:] == ["--enforce-eager", "--gpu-memory-utilization=0.9"]


@pytest.mark.parametrize(
    "extra", ["--block-size", "--kv-transfer-config={}", "--model", "--kv-events-config={}"]
)
def test_domain_flags_cannot_be_overridden_by_extras(extra: str) -> None:
    launch = VllmLaunch(
        model="m", platform="cuda", block_size=16, kv_dtype="float16", extra_args=(extra, "x")
    )
    with pytest.raises(VllmCommandError, match=extra.split("=")[0]):
        vllm_command({}, launch)


def test_bad_tp_size() -> None:
    launch = VllmLaunch(
        model="m", platform="cuda", block_size=16, kv_dtype="float16", tensor_parallel_size=0
    )
    with pytest.raises(VllmCommandError, match="tensor parallel"):
        vllm_command({}, launch)


EVENTS = (
    '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:20004", '
    '"replay_endpoint": "tcp://*:20005"}'
)


def test_kv_events_config_reaches_vllm_from_the_worker_flag() -> None:
    launch = VllmLaunch(
        model="m", platform="cuda", block_size=16, kv_dtype="float16", kv_events_config=EVENTS
    )
    argv = vllm_command({}, launch)
    assert json.loads(_flag(argv, "--kv-events-config")) == json.loads(EVENTS)
    assert argv.count("--kv-events-config") == 1
    assert "--kv-events-config" not in vllm_command({}, CUDA)


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]"])
def test_kv_events_config_must_be_a_json_object(bad: str) -> None:
    launch = VllmLaunch(
        model="m", platform="cuda", block_size=16, kv_dtype="float16", kv_events_config=bad
    )
    with pytest.raises(VllmCommandError, match="--kv-events-config"):
        vllm_command({}, launch)
