"""Device dispatch: CPU fallback, clear errors for absent accelerators, and the NPU branch.

The NPU branch cannot run here (no NPU, no torch_npu): it is exercised by injecting a fake
``torch_npu`` module and a fake ``torch.npu`` API. That is a mock of hardware that does not
exist on this machine; it proves only the dispatch logic, not NPU numerics.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kvpool.kernels import device, layouts


def test_cpu_is_picked_without_accelerators() -> None:
    assert device.pick_device().type in ("cpu", "cuda", "npu")
    assert device.pick_device("cpu") == torch.device("cpu")
    assert device.kind_of(torch.zeros(1)) == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="machine has CUDA")
def test_absent_cuda_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no CUDA device"):
        device.pick_device("cuda")


def test_unknown_device_names_the_choices() -> None:
    with pytest.raises(ValueError, match="cpu, cuda, npu"):
        device.pick_device("tpu")


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = types.SimpleNamespace(name="torch_npu")  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(
        torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False
    )


def test_npu_is_preferred_when_torch_npu_sees_a_device(fake_npu: None) -> None:
    assert device.probe().best() == "npu"


def test_registered_accelerated_op_is_used_then_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(device, "_ACCELERATED", {})
    device.register_accelerated("paged_to_chunk", "cpu", lambda *a, **k: calls.append("fast"))
    caches = [torch.zeros((2, 2, 4, 1, 8))]
    out = torch.full((2, 1, 2, 8), 5.0)
    layouts.paged_to_chunk(caches, torch.tensor([0, 1]), out)
    assert calls == ["fast"] and torch.all(out == 5.0)  # the registered op ran, not the fallback
    monkeypatch.setattr(device, "_ACCELERATED", {})
    layouts.paged_to_chunk(caches, torch.tensor([0, 1]), out)
    assert torch.all(out == 0.0)
