"""The `rlflow` command. Exit codes: 0 ok, 1 internal error (with traceback), 2 invalid input, 3 not available."""

from __future__ import annotations

import argparse
import json
import sys
import traceback

from rlflow import __version__
from rlflow.errors import PipelineInvalid

EXIT_OK, EXIT_BUG, EXIT_INVALID, EXIT_UNAVAILABLE = 0, 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rlflow", description="Asynchronous RL post-training from a declarative pipeline.")
    ap.add_argument("--version", action="version", version=f"rlflow {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def overrides(p):
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a pipeline field, e.g. --set stages.train.lr=1e-5 (repeatable)")

    p = sub.add_parser("compile", help="validate a pipeline, write .rlflow/plan.json and a picture, print the summary")
    p.add_argument("pipeline", help="pipeline YAML file")
    p.add_argument("-o", "--output", default=None, help="plan path (default .rlflow/plan.json)")
    overrides(p)
    p = sub.add_parser("validate", help="check a pipeline and report every problem; writes nothing")
    p.add_argument("pipeline")
    overrides(p)
    sub.add_parser("schema", help="print the pipeline JSON Schema (for editor completion)")
    p = sub.add_parser("run", help="execute a compiled plan on Ray")
    p.add_argument("plan", nargs="?", default=None, help="plan path (default .rlflow/plan.json)")
    p.add_argument("--resume", action="store_true", help="continue from the plan's last checkpoint")
    overrides(p)
    return ap


def _compile(args) -> int:
    from rlflow.compiler import DEFAULT_PLAN, compile_pipeline, summary, write_plan

    plan = compile_pipeline(args.pipeline, args.overrides)
    path, svg = write_plan(plan, args.output or DEFAULT_PLAN)
    print(summary(plan))
    print(f"\nwrote {path} and {svg}")
    print(f"next: rlflow run {path if args.output else ''}".rstrip())
    return EXIT_OK


def _validate(args) -> int:
    from rlflow.compiler import check_pipeline

    spec, _ = check_pipeline(args.pipeline, args.overrides)
    print(f"{args.pipeline}: ok ({len(spec.stages)} stages, {len(spec.edges)} edges)")
    return EXIT_OK


def _schema(args) -> int:
    from rlflow.schema import Pipeline

    print(json.dumps(Pipeline.model_json_schema(by_alias=True), indent=2))
    return EXIT_OK


def _run(args) -> int:
    from rlflow.compiler import DEFAULT_PLAN, compile_pipeline, read_plan, write_plan

    plan = read_plan(args.plan or DEFAULT_PLAN)
    if args.overrides:
        plan = compile_pipeline(plan["source"], plan["overrides"] + args.overrides)
        write_plan(plan, args.plan or DEFAULT_PLAN)
    print(f"plan '{plan['name']}' is valid, but the Ray runtime has not landed yet (issue 6); nothing was run.",
          file=sys.stderr)
    return EXIT_UNAVAILABLE


COMMANDS = {"compile": _compile, "validate": _validate, "schema": _schema, "run": _run}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except PipelineInvalid as e:
        print(e.render(), file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception:  # a bug in rlflow: show everything
        traceback.print_exc()
        print("\nthis is a bug in rlflow; please report it with the traceback above", file=sys.stderr)
        return EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())
