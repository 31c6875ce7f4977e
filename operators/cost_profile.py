"""A cost-model profile file (configs/profiles/*.json): one engine's measured or published StaleFlow costs.

Read by the simulator (engine timing) and by `rlflow run` (cost-model routing, skew-aware dispatch);
written by `rlflow profile`. Pure Python: no Ray, no torch.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parents[1] / "configs" / "profiles"


class ProfileError(ValueError):
    """A profile file that is missing or incomplete; the message names the file and what is wrong."""


def profile_path(name_or_path: str | Path) -> Path:
    """A profile's file: the path as given, or a bare name looked up in configs/profiles/."""
    path = Path(name_or_path)
    return PROFILE_DIR / f"{name_or_path}.json" if not path.suffix else path


@dataclass(frozen=True)
class CostProfile:
    """Per-instance rollout cost model (StaleFlow Appendix B) plus the costs the paper leaves out."""

    name: str
    k1: float  # s per KV unit per decode step (attention reads the KV cache)
    k2: float  # s per decode step, matmul memory-bound floor
    k3: float  # s per running trajectory per decode step, matmul compute-bound slope
    k4: float  # s per decode step, other overheads
    k5: float  # KV units per token held
    kv_budget: float  # M, KV units an instance may hold; beyond it work waits
    max_running: int  # engine cap on running trajectories (vLLM max_num_seqs)
    prefill_s_per_token: float  # prefill / re-prefill cost; stalls the instance's decoding
    pull_s: float  # weight pull; stalls the instance's decoding
    # s per decode iteration an instance spends outside its engine while it holds work: the driver steps each engine
    # (a round trip per `engine.step`), where StaleFlow's engines decode continuously. 0 unless measured in a run
    # (`rlflow profile PIPELINE`); the simulator adds it to every decode step and counts it as not busy
    hop_s: float = 0.0
    # decode iterations an engine runs per step call (the hf engine's chunk_size): work routed to it joins its batch
    # only between calls, so a slot freed mid-call stays empty until the call ends. 0: continuous batching (StaleFlow's
    # engines; vLLM), work joins at once. Measured in a run (`rlflow profile PIPELINE`: the most iterations a call ran)
    chunk_steps: int = 0
    engine: str | None = None  # engine measured (registry name, e.g. "hf"); None: not recorded
    model: str | None = None  # model path the engine loaded (e.g. "builtin:tiny-llama"); None: not recorded

    def step_latency(self, kv_units: float, running: int) -> float:
        """Eq. 11: k1 * kv_cache + max(k2, k3 * n) + k4, plus the hop a stepped engine pays per decode step."""
        return self.k1 * kv_units + max(self.k2, self.k3 * running) + self.k4 + self.hop_s

    @property
    def kv_tokens(self) -> float:
        """KV budget expressed in tokens held."""
        return self.kv_budget / self.k5

    @classmethod
    def load(cls, name_or_path: str | Path) -> CostProfile:
        """Read a profile JSON; a bare name is looked up in configs/profiles/. Doc keys are ignored."""
        path = profile_path(name_or_path)
        if not path.exists():
            raise ProfileError(f"profile: no file {path}; shipped: {sorted(p.stem for p in PROFILE_DIR.glob('*.json'))}")
        raw = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        values = {k: v["value"] if isinstance(v, dict) else v for k, v in raw.items() if k in known}
        missing = required - set(values)
        if missing:
            raise ProfileError(f"profile {path}: missing {sorted(missing)}")
        return cls(**values)
