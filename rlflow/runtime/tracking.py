"""MLflow for `rlflow run`: one run, params from the plan, metrics in batches, plots as artifacts.

The run is named after the pipeline and its start (`quickstart-20261126-031502`, UTC) unless
tracking.mlflow.run_name names it; metrics get their grouped names at this boundary (metric_names.py).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from rlflow.plan_model import Plan
from rlflow.runtime import metric_names


def _flatten(d, prefix=""):
    out = {}
    for k, v in (d.items() if isinstance(d, dict) else enumerate(d)):
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list)) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def run_name(plan: Plan, now: float | None = None) -> str:
    """tracking.mlflow.run_name, else the pipeline's name and the UTC start time: 'quickstart-20261126-031502'."""
    name = plan.pipeline["tracking"]["mlflow"]["run_name"]
    stamp = datetime.fromtimestamp(time.time() if now is None else now, UTC).strftime("%Y%m%d-%H%M%S")
    return name or f"{plan.name}-{stamp}"


def params_of(plan: Plan) -> dict[str, str]:
    """The resolved pipeline, flattened, as MLflow params; unset fields (None) are left out."""
    params = {k: str(v)[:500] for k, v in _flatten(plan.pipeline).items() if v is not None}
    params["control.staleness"] = json.dumps(plan.staleness.model_dump(mode="json", exclude_unset=True))
    return params


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///` tracking URI, else None."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


def store_lock(uri: str):
    """Held while a process first opens the MLflow store at `uri`: two runs starting side by side in a new
    directory both create and migrate the same sqlite file (the second failed with "duplicate column" on MLflow's
    ALTER TABLE), and both create the same experiment. A lock file beside the database serialises them."""
    from contextlib import nullcontext

    from rlflow.runtime.run_lock import serialised

    db = sqlite_path(uri)
    if db is None:  # a tracking server serialises its own store
        return nullcontext()
    return serialised(db.with_name(db.name + ".lock"), what=f"creating the MLflow store {db}",
                      timeout_s=STORE_LOCK_TIMEOUT_S)


STORE_LOCK_TIMEOUT_S = 120.0  # creating and migrating a fresh store takes a few seconds on 2 busy cores

#: MLflow 3's experiment tag for what an experiment holds: "genai_development" (traces, the GenAI overview) or
#: "custom_model_development" (model training: the runs table, the metric charts). Set by MLflow's UI when a person
#: picks the kind, read by its experiment page (and by MLflow's own assistant) to choose where the experiment opens.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"


def mark_training_experiment(client, experiment) -> None:
    """Tag the experiment as a model-training one, unless it already says what it is (a kind someone chose in the UI
    stays): MLflow 3's UI otherwise opens it on its GenAI overview, with the runs a tab away."""
    if EXPERIMENT_KIND_TAG not in (experiment.tags or {}):
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)


def model_name(pipeline: str, step: int) -> str:
    """The name of the run's logged model: `<pipeline>-step<N>` (`quickstart-step100`); characters MLflow refuses in
    a model's name (`/ : . % " '`) become `-`."""
    return re.sub(r"[/:.%\"']", "-", f"{pipeline}-step{step}")


class Tracker:
    """Thin wrapper so the driver logs through one object; metrics are buffered and sent with log_batch."""

    def __init__(self, plan: Plan, run_id: str | None = None):
        import mlflow

        self.mlflow = mlflow
        spec = plan.pipeline["tracking"]["mlflow"]
        uri = spec["uri"] or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"
        mlflow.set_tracking_uri(uri)
        self.uri = uri
        with store_lock(uri):  # the first use creates (or migrates) the store and the experiment
            experiment = mlflow.set_experiment(spec["experiment"] or plan.name)
            mark_training_experiment(mlflow.tracking.MlflowClient(), experiment)
        self.experiment_id = experiment.experiment_id
        self.pipeline = plan.name
        # a resumed run continues its own MLflow run (by id), under the name it started with
        run = mlflow.start_run(run_id=run_id) if run_id else mlflow.start_run(run_name=run_name(plan))
        self.run_id = run.info.run_id
        self.client = mlflow.tracking.MlflowClient()
        self._pending = []
        self._per_task = len(plan.tasks) > 1  # one task type: its task/<task>/ numbers are the whole batch's
        self._moved: set[str] = set()  # counters that have been non-zero: logged at every step from then on
        if run_id is None:
            items = list(params_of(plan).items())
            for i in range(0, len(items), 100):
                mlflow.log_params(dict(items[i:i + 100]))
            self.log_json("plan.json", plan.raw)

    def log_metrics(self, metrics: dict, step: int) -> None:
        """A row's numbers under their MLflow names (metric_names.py) at `step`: step and version are the axis, not
        metrics; a counter is left out until its first non-zero value; start-up times (`startup/<mark>_s`) become
        tags."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        for k, v in metrics.items():
            if v is None or isinstance(v, (str, bool)):
                continue
            if tag := metric_names.startup_tag(k):
                self.mlflow.set_tag(tag, f"{v:.2f}")
                continue
            name = metric_names.mlflow_key(k, per_task=self._per_task)
            if name is None:
                continue
            if metric_names.sparse(k) and name not in self._moved:
                if not v:
                    continue
                self._moved.add(name)
            self._pending.append(Metric(name, float(v), now, step))
        if len(self._pending) >= 200:
            self.flush()

    def flush(self) -> None:
        for i in range(0, len(self._pending), 1000):
            self.client.log_batch(self.run_id, metrics=self._pending[i:i + 1000])
        self._pending = []

    def log_json(self, name: str, obj) -> None:
        self.mlflow.log_dict(obj, name)

    def log_file(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.mlflow.log_artifact(str(path), artifact_path)

    def log_figures(self, history: list[dict], staleness: list[int], timeline: list[tuple], eta: int | None,
                    predicted: float | None) -> None:
        """Staleness distribution, per-instance load timeline and learning curves as PNGs."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        with tempfile.TemporaryDirectory() as tmp:
            fig, ax = plt.subplots(figsize=(5, 3.2))
            top = max(staleness, default=0)
            ax.hist(staleness, bins=[x - 0.5 for x in range(top + 2)], rwidth=0.8)
            if eta is not None:
                ax.axvline(eta + 0.5, color="r", ls="--", label=f"bound eta={eta}")
            mean = sum(staleness) / len(staleness) if staleness else 0
            ax.axvline(mean, color="k", label=f"measured mean {mean:.2f}")
            if predicted is not None:
                ax.axvline(predicted, color="g", ls=":", label=f"predicted {predicted:.2f}")
            ax.set_xlabel("staleness (steps)")
            ax.set_ylabel("groups trained")
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(f"{tmp}/staleness.png", dpi=110)
            plt.close(fig)

            fig, ax = plt.subplots(figsize=(6, 3.2))
            for inst in sorted({i for _, i, _ in timeline}):
                pts = [(t, n) for t, i, n in timeline if i == inst]
                ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", label=f"instance {inst}")
            ax.set_xlabel("seconds")
            ax.set_ylabel("running trajectories")
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(f"{tmp}/instance_load.png", dpi=110)
            plt.close(fig)

            fig, axes = plt.subplots(1, 2, figsize=(8, 3))
            steps = [h["step"] for h in history]
            nan = float("nan")  # a step that scored nothing new has no reward point
            axes[0].plot(steps, [nan if h["reward_all_mean"] is None else h["reward_all_mean"] for h in history], label="all rollouts")
            axes[0].plot(steps, [h["reward_mean"] for h in history], label="trained (after filter)", alpha=0.6)
            axes[0].set_xlabel("step")
            axes[0].set_ylabel("mean reward")
            axes[0].legend(fontsize=7)
            axes[1].plot(steps, [h["loss"] for h in history])
            axes[1].set_xlabel("step")
            axes[1].set_ylabel("loss")
            fig.tight_layout()
            fig.savefig(f"{tmp}/learning_curves.png", dpi=110)
            plt.close(fig)
            self.mlflow.log_artifacts(tmp, "plots")

    def log_model(self, export_dir: str | Path, *, step: int, info: dict) -> str:
        """An export as this run's MLflow model `<pipeline>-step<N>` (model_name; transformers flavor,
        text-generation), logged from a pipeline loaded from the directory; plan.json, rlflow_export.json and rlflow_build.json go under the model's
        rlflow/. Pinned pip requirements: MLflow then infers none (inferring loads the model again). Costs a load and
        a save of the model, and once per process a scan of the installed packages (~1-4 s on 2 busy cores).
        Returns the model URI."""
        import importlib.metadata as md
        import logging
        import shutil

        import mlflow.transformers
        import transformers

        reqs = [f"{p}=={md.version(p)}" for p in ("torch", "transformers", "safetensors")]
        quiet = logging.getLogger("mlflow.transformers")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # no model card or license to fetch for a local directory: not worth a warning
        try:
            export_dir = Path(export_dir)
            # a pipeline object, not the directory: MLflow 3.17's local-checkpoint path reads the task's class from
            # transformers.pipelines.check_task, which transformers 5.23 returns as a name (AttributeError). Loading
            # reads only the model's own files, so the export's step-<N>/ subdirectories need no staging copy.
            model = transformers.pipeline("text-generation", model=str(export_dir), tokenizer=str(export_dir))
            logged = mlflow.transformers.log_model(transformers_model=model, name=model_name(self.pipeline, step),
                                                   task="text-generation",
                                                   pip_requirements=reqs, step=step,
                                                   metadata={k: v for k, v in info.items() if v is not None})
            with tempfile.TemporaryDirectory() as extras:  # the plan and the export's provenance, beside the model
                for f in export_dir.glob("*.json"):
                    if f.name.startswith(("plan", "rlflow_")):
                        shutil.copy2(f, Path(extras) / f.name)
                mlflow.MlflowClient().log_model_artifacts(logged.model_id, extras, "rlflow")
        finally:
            quiet.setLevel(level)
        return logged.model_uri

    def end(self, status: str = "FINISHED") -> None:
        self.flush()
        self.mlflow.end_run(status=status)
