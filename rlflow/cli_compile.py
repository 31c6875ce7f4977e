"""`rlflow compile`, `validate`, `show` and `schema`: a pipeline checked, lowered, written or printed."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from rlflow.cli_options import EXIT_OK, Bare, Gpus, PipelineFile, Sets, overrides_of

Output = Annotated[str | None, typer.Option("-o", "--output", show_default=False,
                                            help="plan path (default .rlflow/plan.json); - writes the plan JSON to stdout "
                                                 "and the summary to stderr")]


def compile_(pipeline: PipelineFile, bare: Bare = None, output: Output = None, gpus: Gpus = None, sets: Sets = None) -> int:
    """validate a pipeline, write .rlflow/plan.json and a picture, print the summary"""
    from rlflow import api
    from rlflow.compiler import DEFAULT_PLAN, summary, write_plan

    plan = api.compile(pipeline, overrides_of(bare, sets), gpus=gpus).raw
    if output == "-":  # a pipe: the plan alone on stdout, no file named '-'
        print(summary(plan), file=sys.stderr)
        print(json.dumps(plan, indent=2))
        return EXIT_OK
    path, svg = write_plan(plan, output or DEFAULT_PLAN)
    print(summary(plan))
    print(f"\nwrote {path} and {svg}")
    print(f"next: rlflow run {path if output else ''}".rstrip())
    return EXIT_OK


def validate(pipeline: PipelineFile, bare: Bare = None, gpus: Gpus = None, sets: Sets = None) -> int:
    """check a pipeline and report every problem; writes nothing"""
    from rlflow.compiler import check_pipeline

    spec, _ = check_pipeline(pipeline, overrides_of(bare, sets), gpus)
    print(f"{pipeline}: ok ({len(spec.stages)} stages, {len(spec.edges)} edges)")
    return EXIT_OK


def show(pipeline: PipelineFile, bare: Bare = None, gpus: Gpus = None, sets: Sets = None) -> int:
    """print the resolved pipeline as YAML, every default filled in (the plan's `pipeline`); writes nothing"""
    import yaml

    from rlflow import api

    plan = api.compile(pipeline, overrides_of(bare, sets), gpus=gpus).raw
    print(yaml.safe_dump(plan["pipeline"], sort_keys=False), end="")
    return EXIT_OK


def schema() -> int:
    """print the pipeline JSON Schema (for editor completion)"""
    from rlflow import registry
    from rlflow.schema import Pipeline

    doc = Pipeline.model_json_schema(by_alias=True)
    # names the string fields accept besides import strings (JSON Schema keeps unknown `x-` keys)
    doc["x-rlflow-builtins"] = {category: registry.builtin_names(category) for category in registry.CATEGORIES}
    print(json.dumps(doc, indent=2))
    return EXIT_OK
