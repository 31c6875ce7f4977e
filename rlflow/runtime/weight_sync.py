"""Weights from train to rollout: the parameter server (StaleFlow §5.1) and the driver's view of it.

The parameter server holds the latest version as one object-store reference: a push is atomic (the
new version becomes visible only once its whole state is in the store) and a pull sees one whole
version. When each instance pulls is the coordinator's sync strategy (operators/sync.py); the Pull
command carries (version, [ref]) into the instance's next step call (rollout_worker.py).
"""

from __future__ import annotations

import ray


@ray.remote(num_cpus=0)
class ParameterServer:
    """Latest weights version, as one object-store reference to a dict of numpy arrays."""

    def __init__(self):
        self._version = -1
        self._ref = None  # [ObjectRef]: wrapped so Ray does not resolve it on return

    def push(self, version: int, state_ref: list) -> int:
        """Publish `version`; `state_ref` is [ray.put(state)] (the put already completed)."""
        if version <= self._version:
            raise ValueError(f"push of version {version} after version {self._version}: versions only grow")
        self._version, self._ref = version, state_ref  # one assignment pair, no await in between: atomic
        return version

    def latest(self) -> tuple[int, list | None]:
        """(version, [ObjectRef]) of the newest whole version; (-1, None) before the first push."""
        return self._version, self._ref


class WeightSync:
    """The driver's handle on the parameter server: the latest published version and its reference."""

    def __init__(self, actor: dict, timeout_s: float):
        self.server = ParameterServer.options(num_cpus=actor["num_cpus"], name=None).remote()
        self.timeout_s = timeout_s
        self.version, self.ref = -1, None

    def refresh(self) -> int:
        """Read the newest version (after the trainer published one)."""
        from rlflow.errors import RunFailed

        try:
            self.version, self.ref = ray.get(self.server.latest.remote(), timeout=self.timeout_s)
        except ray.exceptions.RayActorError as err:
            raise RunFailed(f"the parameter server died ({type(err).__name__}); rlflow run --resume continues from "
                            "the last checkpoint") from None
        except ray.exceptions.GetTimeoutError:
            raise RunFailed(f"the parameter server did not answer within {self.timeout_s:.0f} s") from None
        return self.version
