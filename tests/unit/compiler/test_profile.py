"""`rlflow profile`: the cost-model fit recovers known coefficients and works on a real engine's steps."""

from __future__ import annotations

import json
import random

import pytest

from rlflow.operators.cost_profile import CostProfile
from rlflow.profile import Sample, fit_profile, measure_engine, write_profile

TRUE = {"k1": 7e-8, "k2": 1.7e-3, "k3": 1.25e-4, "k4": 1.07e-2}  # StaleFlow Table 4 (crossover n* = 13.6)


def synthetic(noise: float, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        for kv in (1e3, 1e4, 5e4, 2e5):
            lat = TRUE["k1"] * kv * n + max(TRUE["k2"], TRUE["k3"] * n) + TRUE["k4"]
            out.append(Sample(kv * n, n, lat * (1 + rng.gauss(0, noise))))
    return out


def test_fit_recovers_the_coefficients_without_noise():
    fit = fit_profile(synthetic(0.0))
    for k in ("k1", "k2", "k3", "k4"):
        assert fit[k] == pytest.approx(TRUE[k], rel=0.01)
    assert fit["crossover"] == pytest.approx(TRUE["k2"] / TRUE["k3"], rel=0.01)  # n* = 13.6, between measured sizes
    assert fit["r2"] > 0.999


def test_fit_is_close_with_measurement_noise():
    fit = fit_profile(synthetic(0.02, seed=3))
    assert fit["k1"] == pytest.approx(TRUE["k1"], rel=0.1)
    assert fit["k3"] == pytest.approx(TRUE["k3"], rel=0.15)
    for s in synthetic(0.0):  # predicts the noise-free latency within a few percent everywhere
        predicted = fit["k1"] * s.kv_cache + max(fit["k2"], fit["k3"] * s.running) + fit["k4"]
        assert predicted == pytest.approx(s.latency_s, rel=0.08)


def test_noise_that_looks_like_a_negative_cost_is_fitted_as_zero():
    # a flat step time with jitter that happens to fall with n and with the KV held (what a tiny CPU
    # model measures under load): unconstrained least squares gives negative slopes or overhead
    samples = [Sample(kv, n, 0.010 - 1e-5 * n - 1e-9 * kv) for n in (2, 8, 16) for kv in (100.0, 900.0)]
    fit = fit_profile(samples)
    assert min(fit["k1"], fit["k2"], fit["k3"], fit["k4"]) >= 0
    assert fit["k1"] == 0 and fit["k3"] * (16 - fit["crossover"]) <= 1e-12  # no slope survives in n or kv
    floor = max(fit["k2"], fit["k3"] * 2) + fit["k4"]
    assert floor == pytest.approx(0.0099, rel=0.02)  # the step time is carried by the constant


def test_a_negative_overhead_is_fitted_as_zero():
    # step time nearly proportional to n, measured a little low at small n: unconstrained, k4 < 0
    samples = [Sample(kv, n, 1e-3 * n - 0.5e-3) for n in (2, 8, 16) for kv in (100.0, 900.0)]
    fit = fit_profile(samples)
    assert min(fit["k1"], fit["k2"], fit["k3"], fit["k4"]) >= 0
    assert fit["k3"] > 5e-4 and fit["r2"] > 0.9  # the slope in n survives the constraint


def test_too_few_batch_sizes_is_an_error():
    with pytest.raises(ValueError, match="3 or more batch sizes"):
        fit_profile([Sample(1.0, 1, 0.1), Sample(2.0, 2, 0.2)] * 4)


def test_written_profile_loads_as_a_cost_profile(tmp_path):
    path = write_profile(fit_profile(synthetic(0.0)), tmp_path / "p.json", name="synthetic", engine="hf",
                         model="builtin:tiny-llama", source="test", max_running=64, kv_budget=32768)
    prof = CostProfile.load(path)
    assert prof.k3 == pytest.approx(TRUE["k3"], rel=1e-3)
    assert (prof.engine, prof.model) == ("hf", "builtin:tiny-llama")  # what the compiler checks a pipeline against
    assert json.loads(path.read_text())["fit"]["crossover"] == pytest.approx(13.6, rel=0.01)


def test_measures_and_fits_a_real_hf_engine():
    from rlflow.stages.engine_hf import HFEngine
    from rlflow.stages.tiny_model import build_tiny_llama

    model = build_tiny_llama("repeat", progress=lambda *a: None)
    engine = HFEngine(model, max_running=16, max_new_tokens=64, chunk_size=2, temperature=1.0)
    prompt = engine.tokenizer("abc*16=")["input_ids"]
    samples = measure_engine(engine, prompt, batch_sizes=(2, 8, 16), repeats=2, log=lambda *a: None)
    assert len({s.running for s in samples}) >= 3  # trajectories finish one by one: sizes below 16 appear too
    assert all(s.latency_s > 0 for s in samples)
    fit = fit_profile(samples)
    assert min(fit["k1"], fit["k2"], fit["k3"], fit["k4"]) >= 0  # every term of Eq. 11 is a cost
    # timing on a shared 2-core machine is noisy, so pin only what load cannot change: the fitted
    # step time is of the measured order at every batch size measured
    median = sorted(s.latency_s for s in samples)[len(samples) // 2]
    for s in samples:
        predicted = fit["k1"] * s.kv_cache + max(fit["k2"], fit["k3"] * s.running) + fit["k4"]
        assert median / 4 < predicted < median * 4


def test_a_pull_is_measured_on_the_engine_and_written_into_the_profile(tmp_path):
    """measure_pull loads the engine's own checkpoint through load_weights (buckets, checksum); the profile keeps it,
    so the simulator stalls an instance for a measured pull, not an assumed zero."""
    from rlflow.profile import measure_pull
    from rlflow.stages.engine_hf import HFEngine
    from rlflow.stages.tiny_model import build_tiny_llama

    model = build_tiny_llama("repeat", progress=lambda *a: None)
    engine = HFEngine(model, max_running=4, max_new_tokens=8)
    pull_s = measure_pull(engine, model, repeat=2)
    assert 0 < pull_s < 30 and engine.version == 2  # it really loaded, twice
    path = write_profile(fit_profile(synthetic(0.0)), tmp_path / "p.json", name="synthetic", engine="hf",
                         model="builtin:tiny-llama", source="test", max_running=64, kv_budget=32768, pull_s=pull_s)
    assert CostProfile.load(path).pull_s == pytest.approx(pull_s)
    assert "measure_pull" in json.loads(path.read_text())["pull_s"]["from"]
    with pytest.raises(ValueError, match="no safetensors"):
        measure_pull(engine, tmp_path)
