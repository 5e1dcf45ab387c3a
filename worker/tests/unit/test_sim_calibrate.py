"""``kvpool-worker calibrate``'s fit, on timings made from known coefficients.

The fit must give back the step model and the link that made the timings (the same functional
form as ``simcore``'s ``StepModel.step_s`` and ``Link.seconds``), never a negative coefficient,
and refuse timings from which no per-step or per-token cost can be read.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.protocol.simcore.profile import StepModel
from kvpool.worker.sim.calibrate import (
    SWEEPS,
    CalibrationError,
    Point,
    fit_link,
    fit_steps,
    nnls,
    predict,
    residuals,
    sweep_points,
)

TRUE = StepModel(
    overhead_s=0.002, prefill_overhead_s=0.001, prefill_token_s=5e-5, attn_s=4e-8,
    decode_seq_s=3e-4, decode_ctx_s=7e-7,
)  # fmt: skip


def timed(points: list[Point], model: StepModel, noise: float = 0.0) -> list[Point]:
    rng = np.random.default_rng(3)
    for p in points:
        p.samples = [predict(model, p) * (1 + noise * float(rng.standard_normal()))]
    return points


def test_nnls_matches_least_squares_when_unconstrained_and_clips_otherwise() -> None:
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert np.allclose(nnls(a, np.array([1.0, 2.0, 3.0])), [1.0, 2.0])
    x = nnls(a, np.array([-1.0, 2.0, 1.0]))  # least squares wants x0 < 0
    assert x[0] == 0.0 and x[1] == pytest.approx(1.5)


def test_the_fit_gives_back_the_coefficients_that_made_the_timings() -> None:
    fitted, held = sweep_points(SWEEPS["quick"])
    model = fit_steps(timed(fitted, TRUE))
    for name in ("overhead_s", "prefill_overhead_s", "prefill_token_s", "attn_s"):
        assert getattr(model, name) == pytest.approx(getattr(TRUE, name), rel=1e-6)
    assert model.decode_ctx_s == pytest.approx(TRUE.decode_ctx_s, rel=1e-6)
    report = residuals(model, timed(held, TRUE))
    assert {"holdout", "mixed"} <= set(report["summary"])
    assert all(abs(p["rel_err"]) < 1e-3 for p in report["points"])


def test_noisy_timings_give_non_negative_coefficients_and_report_residuals() -> None:
    fitted, _ = sweep_points(SWEEPS["quick"])
    model = fit_steps(timed(fitted, TRUE, noise=0.2))
    assert min(getattr(model, k) for k in model.__struct_fields__) >= 0
    summary = residuals(model, fitted)["summary"]
    assert summary["decode"]["points"] == 12 and summary["prefill"]["rms_rel_err"] > 0


def test_timings_without_a_per_token_cost_are_refused() -> None:
    fitted, _ = sweep_points(SWEEPS["tiny"])
    flat = StepModel(overhead_s=0.01, prefill_token_s=0.0, attn_s=0.0, decode_seq_s=0.0,
                     decode_ctx_s=0.0)  # fmt: skip
    with pytest.raises(CalibrationError, match="too noisy"):
        fit_steps(timed(fitted, flat))


def test_a_link_is_latency_plus_bytes_over_bandwidth() -> None:
    kv = 4096
    samples = {n: [0.0005 + n * kv / 3e9] for n in (256, 1024, 4096)}
    link, report = fit_link(samples, kv)
    assert link.gbps == pytest.approx(3.0, rel=1e-3)
    assert link.latency_s == pytest.approx(0.0005, abs=1e-6)
    assert [p["tokens"] for p in report["points"]] == [256, 1024, 4096]
    with pytest.raises(CalibrationError):
        fit_link({256: [0.002], 4096: [0.001]}, kv)
