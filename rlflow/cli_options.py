"""What the `rlflow` commands share: exit codes, the option types several take, and overrides given bare or by --set."""

from __future__ import annotations

from typing import Annotated

import typer

EXIT_OK, EXIT_BUG, EXIT_INVALID, EXIT_UNAVAILABLE = 0, 1, 2, 3

OVERRIDE_HELP = "override a pipeline field, e.g. --set stages.train.lr=1e-5 (repeatable; a bare KEY=VALUE does the same)"


def gpu_count(text: str) -> int:
    """--gpus N: a whole number >= 0 (a usage error, exit 2, on anything else)."""
    if not str(text).isdigit():
        raise typer.BadParameter(f"a whole number of GPUs, 0 or more, not {text!r}")
    return int(text)


Sets = Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE", help=OVERRIDE_HELP, show_default=False)]
Bare = Annotated[list[str] | None, typer.Argument(metavar="KEY=VALUE", show_default=False,
                                                  help="overrides, as with --set (e.g. stages.train.steps=10)")]
Gpus = Annotated[int | None, typer.Option("--gpus", metavar="N", parser=gpu_count, show_default=False,
                                          help="compile for a cluster of N GPUs (default: the GPUs of this machine; a "
                                               "cluster joined with resources.address is not counted)")]
PipelineFile = Annotated[str, typer.Argument(metavar="PIPELINE", help="pipeline YAML file", show_default=False)]
PlanFile = Annotated[str | None, typer.Argument(metavar="PLAN", show_default=False,
                                                help="plan path (default .rlflow/plan.json)")]


def overrides_of(bare: list[str] | None, sets: list[str] | None) -> list[str]:
    """The overrides of a command line: bare KEY=VALUE arguments, then every --set, in order. A bare argument
    without '=' is a usage error that says how overrides are written."""
    for item in bare or []:
        if "=" not in item:
            raise typer.BadParameter(f"unexpected argument {item!r}: an override is dotted.key=value, bare or after "
                                     "--set (e.g. stages.train.steps=10)", param_hint="KEY=VALUE")
    return [*(bare or []), *(sets or [])]
