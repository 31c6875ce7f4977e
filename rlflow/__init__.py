"""rlflow: asynchronous RL post-training of language models from a declarative pipeline.

The Python API (rlflow/api.py, docs/guides/python-api.md): rlflow.compile, rlflow.run, rlflow.simulate, rlflow.tune,
and their RunResult / TuneResult. Loaded on first use (PEP 562 module __getattr__): `from rlflow import registry` in
any of rlflow's modules must not import the API, which imports most of rlflow (tests/unit/repo/test_import_cycles.py
counts every `from rlflow import ...` as an edge to this package, so the API is loaded by name, not imported here).
"""

import importlib

from rlflow.runtime.run_log import quiet_deepspeed
from rlflow.version import __version__

# before anything imports DeepSpeed (the trainer, an export, MLflow's transformers flavor): its "Setting accelerator
# to CPU" WARNING goes to the run's run.log, not the terminal (runtime/run_log.py; a filter, DeepSpeed not imported)
quiet_deepspeed()

API = ("compile", "run", "simulate", "tune", "RunResult", "TuneResult")
__all__ = ["__version__", *API]


def __getattr__(name: str):
    if name in API:
        return getattr(importlib.import_module("rlflow.api"), name)
    raise AttributeError(f"module 'rlflow' has no attribute {name!r}")
