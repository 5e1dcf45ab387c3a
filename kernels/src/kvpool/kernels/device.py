"""The one place that decides CPU, CUDA or Ascend NPU for kvpool's KV kernels.

Why this module exists: every kernel in this package is written once in PyTorch and must run
unchanged on a CPU (tests and the demo), a CUDA GPU, and an Ascend NPU through ``torch_npu``.
Device probing, the lazy ``torch_npu`` import (nothing imports it unless it is installed) and
the per-device choice of an accelerated op live here, so no kernel module grows its own
``if npu: ... elif cuda: ...`` ladder.

NPU status, stated plainly: no NPU exists on the machines that test kvpool. The NPU branch is
exercised only by the unit test that injects a fake ``torch_npu`` module; every kernel falls
back to its PyTorch implementation there, which torch_npu executes as ordinary aten ops. No
AscendC or ``torch_npu``-specific op is registered today, so "unverified on NPU" covers every
kernel's performance and its numerical behaviour on that device.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch

DeviceKind = Literal["cpu", "cuda", "npu"]
_KINDS: tuple[DeviceKind, ...] = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class Backends:
    """Which accelerators this process can use."""

    cuda: bool
    npu: bool

    def best(self) -> DeviceKind:
        if self.npu:
            return "npu"
        if self.cuda:
            return "cuda"
        return "cpu"


def torch_npu_module() -> ModuleType | None:
    """``torch_npu`` if it is installed (importing it registers the NPU device), else None."""
    if importlib.util.find_spec("torch_npu") is None:
        return None
    return importlib.import_module("torch_npu")


def probe() -> Backends:
    npu = False
    mod = torch_npu_module()
    if mod is not None:
        npu_api = getattr(torch, "npu", None)
        npu = bool(npu_api is not None and npu_api.is_available())
    return Backends(cuda=torch.cuda.is_available(), npu=npu)


def pick_device(prefer: str | None = None) -> torch.device:
    """The device to run on: ``prefer`` if given ("cpu", "cuda", "npu", "cuda:1"), else the
    best available. Asking for an accelerator that is absent is an error naming the fix."""
    backends = probe()
    if prefer is None:
        return torch.device(backends.best())
    kind = prefer.split(":", 1)[0]
    if kind not in _KINDS:
        raise ValueError(f"device {prefer!r}: expected one of cpu, cuda, npu (optionally ':N')")
    if kind == "cuda" and not backends.cuda:
        raise ValueError(f"device {prefer!r}: no CUDA device is visible; use 'cpu'")
    if kind == "npu" and not backends.npu:
        raise ValueError(
            f"device {prefer!r}: torch_npu is not installed or sees no NPU; use 'cpu' or 'cuda'"
        )
    return torch.device(prefer)


def kind_of(tensor: torch.Tensor) -> DeviceKind:
    kind = tensor.device.type
    if kind == "cuda":
        return "cuda"
    if kind in ("npu", "privateuseone"):
        return "npu"
    return "cpu"


OpFn = Callable[..., object]
_ACCELERATED: dict[tuple[str, DeviceKind], OpFn] = {}


def register_accelerated(name: str, kind: DeviceKind, fn: OpFn) -> None:
    """Register a device-specific implementation of kernel ``name`` (e.g. a torch_npu op
    wrapper). Kernels ask :func:`accelerated` first and fall back to their torch code."""
    _ACCELERATED[(name, kind)] = fn


def accelerated(name: str, tensor: torch.Tensor) -> OpFn | None:
    """The registered implementation of ``name`` for ``tensor``'s device, or None."""
    return _ACCELERATED.get((name, kind_of(tensor)))
