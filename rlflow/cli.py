"""The `rlflow` command, on typer. Exit codes: 0 ok, 1 internal error (with traceback), 2 invalid input (usage errors
too), 3 not available. The commands live by concern: cli_compile.py, cli_run.py, cli_sim.py, cli_model.py."""

from __future__ import annotations

import functools
import sys
import traceback
from typing import Annotated

import typer
import typer._click as click  # typer's own copy of click: its exceptions are the ones raised here

from rlflow import cli_compile, cli_model, cli_run, cli_sim
from rlflow.cli_options import EXIT_BUG, EXIT_INVALID, EXIT_OK, EXIT_UNAVAILABLE
from rlflow.errors import PipelineInvalid, RunFailed
from rlflow.version import __version__

app = typer.Typer(name="rlflow", help="Asynchronous RL post-training from a declarative pipeline.", no_args_is_help=True,
                  pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]})


def _version(value: bool) -> None:
    if value:
        print(f"rlflow {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print the version and exit")] = False) -> None:
    """Asynchronous RL post-training from a declarative pipeline."""


def handled(command):
    """A command whose failures become exit codes: invalid input 2 (no traceback), a run stopped for a reason it
    names 3, Ctrl-C 130 (or the signal's code), a bug 1 with its traceback. Usage errors pass on to `main`."""

    @functools.wraps(command)
    def guarded(*args, **kwargs) -> int:
        try:
            return command(*args, **kwargs)
        except (click.ClickException, typer.Exit, typer.Abort):
            raise
        except PipelineInvalid as e:
            print(e.render(), file=sys.stderr)
            return EXIT_INVALID
        except KeyboardInterrupt as e:  # a second Ctrl-C (or SIGTERM) while stopping: what was left unwritten
            print(e.describe() if hasattr(e, "describe") else "interrupted", file=sys.stderr)
            return getattr(e, "exit_code", 130)
        except RunFailed as e:  # the run stopped for a reason it names (stall, dead trainer, failed stream)
            if not getattr(e, "announced", False):  # the driver logs the stops it sees itself
                print(f"run stopped: {e}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        except Exception:  # a bug in rlflow: show everything
            traceback.print_exc()
            print("\nthis is a bug in rlflow; please report it with the traceback above", file=sys.stderr)
            return EXIT_BUG

    return guarded


#: name -> function, in the order `rlflow --help` lists them; each function's docstring is its help line
COMMANDS = {"compile": cli_compile.compile_, "validate": cli_compile.validate, "show": cli_compile.show,
            "schema": cli_compile.schema, "run": cli_run.run, "scale": cli_run.scale, "simulate": cli_sim.simulate,
            "tune": cli_sim.tune, "profile": cli_sim.profile, "export": cli_model.export, "eval": cli_model.eval_,
            "doctor": cli_model.doctor}
for _name, _command in COMMANDS.items():
    app.command(_name)(handled(_command))


def _resume_without_run(argv: list[str]) -> list[str]:
    """`rlflow run --resume` with no RUN after it means the newest run (argparse's nargs='?'; click options take a
    value or none, not either)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--":
            break
        if arg == "--resume" and (i + 1 == len(out) or out[i + 1].startswith("-")):
            out.insert(i + 1, "latest")
    return out


def main(argv: list[str] | None = None) -> int:
    """The console entry point (`rlflow`): the exit code of the command, or SystemExit(2) on a usage error."""
    args = _resume_without_run(sys.argv[1:] if argv is None else argv)
    try:
        code = typer.main.get_command(app).main(args=args, prog_name="rlflow", standalone_mode=False)
    except click.ClickException as e:  # a usage error: what is wrong and the usage line, exit 2 (as argparse did)
        try:
            from typer import rich_utils

            rich_utils.rich_format_error(e)
        except ImportError:
            e.show()
        raise SystemExit(e.exit_code) from None
    except typer.Abort:
        print("interrupted", file=sys.stderr)
        return 130
    return code if isinstance(code, int) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
