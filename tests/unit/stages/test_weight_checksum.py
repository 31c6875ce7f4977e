"""The weights checksum (stages/checksum.py), engines' reports of what they loaded, and the driver's check."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

from rlflow.errors import RunFailed  # noqa: E402
from rlflow.stages.checksum import checksum  # noqa: E402
from rlflow.stages.engine import WeightsLoaded  # noqa: E402


def state(seed: int = 0) -> dict[str, np.ndarray]:
    """Tensors of awkward sizes: a multiple of the 8 KiB row, a tail only, a row plus a tail, a scalar, ints."""
    rng = np.random.default_rng(seed)
    return {"a.weight": rng.standard_normal((64, 128), dtype=np.float32),  # 32 KiB: rows only
            "b.bias": rng.standard_normal(7, dtype=np.float32),  # tail only
            "c.weight": rng.standard_normal((3, 1000), dtype=np.float32),  # one row + tail
            "d.scale": np.array(1.5, dtype=np.float32),
            "e.index": np.arange(10, dtype=np.int64)}


def changed(s: dict, name: str, fn) -> dict:
    out = dict(s)
    out[name] = fn(s[name].copy())
    return out


def test_equal_bytes_equal_checksum_whatever_holds_them():
    s = state()
    readonly = {}
    for k, v in s.items():
        readonly[k] = v.copy()
        readonly[k].flags.writeable = False  # like ray.get's zero-copy views
    tensors = {k: torch.from_numpy(v.copy()) for k, v in s.items()}
    reordered = dict(reversed(list(s.items())))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no read-only numpy -> torch warning escapes
        sums = {checksum(s), checksum(readonly), checksum(tensors), checksum(reordered)}
    assert len(sums) == 1 and sums.pop().startswith("b2m2:")


def test_strided_and_offset_tensors_checksum_as_their_values():
    base = torch.arange(3 * 4097, dtype=torch.float32)
    sliced = base[1:1 + 2 * 4096]  # storage offset of 4 bytes: not int64-aligned
    assert checksum({"x": sliced}) == checksum({"x": sliced.clone()})
    t = torch.arange(64 * 128, dtype=torch.float32).view(64, 128)
    assert checksum({"x": t.t()}) == checksum({"x": t.t().contiguous()})


@pytest.mark.parametrize("corruption", [
    "one element, last bit", "one element in the tail", "two elements swapped", "two rows swapped",
    "transposed square", "zeroed", "tensors swapped", "name changed", "dtype changed", "shape changed",
    "tensor missing"])
def test_any_corruption_changes_the_checksum(corruption):
    s = state()
    s["sq.weight"] = np.random.default_rng(1).standard_normal((64, 64), dtype=np.float32)
    s["sq2.weight"] = np.random.default_rng(2).standard_normal((64, 64), dtype=np.float32)

    def flip_last_bit(a):
        a.view(np.uint32)[5, 9] ^= 1
        return a

    def swap(a, i, j):
        a.reshape(-1)[[i, j]] = a.reshape(-1)[[j, i]]
        return a

    bad = {
        "one element, last bit": lambda: changed(s, "a.weight", flip_last_bit),
        "one element in the tail": lambda: changed(s, "c.weight", lambda a: (a.__setitem__((2, 999), a[2, 999] + 1), a)[1]),
        "two elements swapped": lambda: changed(s, "a.weight", lambda a: swap(a, 3, 700)),
        "two rows swapped": lambda: changed(s, "a.weight", lambda a: a[[1, 0, *range(2, 64)]]),
        "transposed square": lambda: changed(s, "sq.weight", lambda a: np.ascontiguousarray(a.T)),
        "zeroed": lambda: changed(s, "a.weight", np.zeros_like),
        "tensors swapped": lambda: s | {"sq.weight": s["sq2.weight"], "sq2.weight": s["sq.weight"]},
        "name changed": lambda: {("z.weight" if k == "a.weight" else k): v for k, v in s.items()},
        "dtype changed": lambda: changed(s, "e.index", lambda a: a.view(np.float64)),
        "shape changed": lambda: changed(s, "a.weight", lambda a: a.reshape(128, 64)),
        "tensor missing": lambda: {k: v for k, v in s.items() if k != "b.bias"},
    }[corruption]()
    assert checksum(bad) != checksum(s)


def test_checksum_is_fixed_across_processes():
    """Publisher and engines run in different processes: the scheme has no per-process randomness."""
    import subprocess
    import sys

    code = ("import numpy as np; from rlflow.stages.checksum import checksum; "
            "print(checksum({'w': np.arange(5000, dtype=np.float32)}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == checksum({"w": np.arange(5000, dtype=np.float32)})


# ---------------------------------------------------------------------------------------- the hf engine's report
transformers = pytest.importorskip("transformers")

from engine_helpers import perturbed_state  # noqa: E402

from rlflow.stages.engine_hf import HFEngine  # noqa: E402


@pytest.fixture(scope="module")
def sent(repeat_model_dir):
    return perturbed_state(transformers.AutoModelForCausalLM.from_pretrained(repeat_model_dir))


class SkipsOne(HFEngine):
    """Silently never copies one tensor (the old weights stay)."""

    def _copy_into(self, target, source):
        if tuple(target.shape) != (self.model.config.hidden_size,):  # skips the norm weights
            super()._copy_into(target, source)


class CorruptsOne(HFEngine):
    """Copies every tensor, then one element of the last one goes wrong."""

    def _copy_into(self, target, source):
        super()._copy_into(target, source)
        if target.dim() == 2:
            target[0, 0] += 1e-3


def test_hf_engine_reports_the_version_and_the_checksum_it_holds(repeat_model_dir, sent):
    engine = HFEngine(repeat_model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read-only views copy in without a warning
        loaded = engine.load_weights(sent, version=4)
    assert loaded == WeightsLoaded(4, checksum(sent))
    held = {k: v for k, v in engine.model.state_dict().items() if k in sent}
    assert checksum(held) == loaded.checksum  # read back from the parameters


@pytest.mark.parametrize("engine_cls", [SkipsOne, CorruptsOne])
def test_hf_engine_reads_back_what_it_holds(engine_cls, repeat_model_dir, sent):
    loaded = engine_cls(repeat_model_dir).load_weights(sent, version=2)
    assert loaded.version == 2 and loaded.checksum != checksum(sent)


def test_hf_engine_in_another_dtype_verifies_against_the_converted_source(repeat_model_dir, sent):
    engine = HFEngine(repeat_model_dir, dtype="bfloat16")
    assert engine.load_weights(sent, version=1).checksum == checksum(sent)
    bad = CorruptsOne(repeat_model_dir, dtype="bfloat16").load_weights(sent, version=1)
    assert bad.checksum != checksum(sent)


# ---------------------------------------------------------------------------------------- the driver's check
def test_verify_loaded_names_stage_instance_version_and_both_checksums():
    from rlflow.runtime.parameter_server import Published, verify_loaded

    sent = Published(3, ["ref"], "b2m1:aaaa")
    verify_loaded("rollout", 1, sent, WeightsLoaded(3, "b2m1:aaaa"))
    with pytest.raises(RunFailed) as err:
        verify_loaded("rollout", 1, sent, WeightsLoaded(3, "b2m1:bbbb"))
    for part in ("rollout stage 'rollout' instance 1", "version 3", "b2m1:aaaa", "b2m1:bbbb"):
        assert part in str(err.value)
    with pytest.raises(RunFailed, match=r"instance 1 was sent weights version 3 but reports it loaded version 2"):
        verify_loaded("rollout", 1, sent, WeightsLoaded(2, "b2m1:aaaa"))
    with pytest.raises(RunFailed, match="reported no load"):
        verify_loaded("rollout", 1, sent, None)


def test_verify_loaded_fails_on_parameters_an_engine_did_not_load():
    from rlflow.runtime.parameter_server import Published, verify_loaded

    with pytest.raises(RunFailed, match=r"instance 0 loaded weights version 5 but its engine did not load 1 of its"):
        verify_loaded("gen", 0, Published(5, ["ref"], "b2m1:aaaa"),
                      WeightsLoaded(5, "b2m1:aaaa", ["model.norm.weight"]))
