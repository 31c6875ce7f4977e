"""What the integration tests share: a shipped pipeline compiled small, and a run of it in this process."""

from __future__ import annotations

from pathlib import Path

from rlflow.compiler import compile_pipeline

REPO = Path(__file__).resolve().parents[2]
SMALL = ["stages.train.steps=3", "stages.buffer.batch_groups=2", "stages.rollout.group_size=4",
         "tracking.progress=false"]


def plan_for(name: str, *extra: str) -> dict:
    """pipelines/<name>.yaml with SMALL overrides, then `extra` (later overrides win)."""
    return compile_pipeline(REPO / "pipelines" / f"{name}.yaml", SMALL + list(extra))


def run_plan(plan: dict, **kwargs):
    """Run the plan to the end in .rlflow/runs/<name> of the working directory; returns the Run."""
    from rlflow.runtime.driver import Run

    kwargs.setdefault("log", lambda *a, **k: None)
    run = Run(plan, out_dir=Path(".rlflow") / "runs" / plan["name"], **kwargs)
    run.run()
    return run


class WeightFileWatch:
    """Polls /dev/shm and the temp dir (and the folders directly in them) while it is open, recording every weight
    file it sees (*.safetensors, *.bin, *.pt): a pull that writes its weights to disk shows up, even if it removes
    them at once (the file reload it replaced kept them about 0.5 s per pull; this polls every 10 ms)."""

    SUFFIXES = (".safetensors", ".bin", ".pt")

    def __init__(self, roots=None):
        import tempfile
        import threading

        self.roots = [r for r in (roots or ["/dev/shm", tempfile.gettempdir()]) if Path(r).is_dir()]
        self.seen: set[str] = set()
        self._before = self._scan()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _scan(self) -> set[str]:
        import os

        found = set()
        for root in self.roots:
            try:
                entries = list(os.scandir(root))
            except OSError:
                continue
            for e in entries:
                paths = [e.path]
                if e.is_dir(follow_symlinks=False) and not e.name.startswith("pytest-of-"):  # the tests' own dirs: exports
                    try:
                        paths += [c.path for c in os.scandir(e.path)]
                    except OSError:
                        pass
                found.update(p for p in paths if p.endswith(self.SUFFIXES))
        return found

    def _poll(self) -> None:
        while not self._stop.wait(0.01):
            self.seen |= self._scan() - self._before

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.seen |= self._scan() - self._before
