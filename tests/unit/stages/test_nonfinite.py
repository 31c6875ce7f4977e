"""A train step that is not finite is never applied nor published (stages/step_checks.py nonfinite_verdict), on a real
DeepSpeed engine and tiny Llama (gloo, one process, CPU)."""

import math

import numpy as np
import pytest
import test_trainer
from trainer_batches import GROUP, load_hf, make_batch

from rlflow.stages.step_checks import nonfinite_verdict

trainer = test_trainer.trainer  # the trainer of those tests; the tiny Llama is tests/unit/conftest.py's


def same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_nan_in_the_batch_is_not_applied_and_the_next_step_trains(tiny_llama_dir, stage):
    """A NaN behaviour log-prob (an engine fault) makes the loss and gradient NaN: the weights stay as they were
    (stage 0: dropped here; ZeRO: DeepSpeed's own overflow skip), and the optimizer is not poisoned for later steps."""
    batch = make_batch(load_hf(tiny_llama_dir))
    bad = make_batch(load_hf(tiny_llama_dir), seed=1)
    bad[0].behaviour_logprobs[0] = float("nan")
    tr = trainer(tiny_llama_dir, stage)
    try:
        before = tr.state_numpy()
        m = tr.train_step(bad, GROUP)
        after = tr.state_numpy()
        good = tr.train_step(batch, GROUP)
        trained = tr.state_numpy()
    finally:
        tr.close()
    assert m["nonfinite"] == "skipped"
    assert math.isnan(m["loss"]) and not math.isfinite(m["grad_norm"])
    assert same(before, after)  # not applied
    assert m["version"] == 1  # still a step: the trainer's version and the driver's step stay in line
    assert good["nonfinite"] == "" and math.isfinite(good["loss"]) and good["grad_norm"] > 0
    assert not same(after, trained)
    assert all(np.isfinite(v).all() for v in trained.values())


def test_an_update_that_makes_the_weights_non_finite_is_called_poisoned(tiny_llama_dir):
    """lr inf (the compile rule lr-out-of-range refuses it; the trainer must not trust that): the gradient is
    finite, the update is not."""
    tr = trainer(tiny_llama_dir, 0, lr=float("inf"))
    try:
        m = tr.train_step(make_batch(load_hf(tiny_llama_dir)), GROUP)
    finally:
        tr.close()
    assert math.isfinite(m["grad_norm"]) and math.isfinite(m["loss"])
    assert m["nonfinite"] == "poisoned"


def test_the_verdict():
    assert nonfinite_verdict(0.5, 1.0, applied=True, weights_finite=True) == ""
    assert nonfinite_verdict(0.5, None, applied=True, weights_finite=True) == ""
    assert nonfinite_verdict(float("nan"), 1.0, applied=True, weights_finite=True) == "skipped"
    assert nonfinite_verdict(0.5, float("inf"), applied=False, weights_finite=True) == "skipped"
    assert nonfinite_verdict(0.5, 1.0, applied=True, weights_finite=False) == "poisoned"
