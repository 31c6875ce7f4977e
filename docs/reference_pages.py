"""Writes the reference pages' generated text (CLI, schema, errors) into their Markdown, so the pages read whole on
GitHub as on the site, and a test can tell when the code has moved on without them.

Each page holds its block between two markers, `<!-- rlflow:NAME -->` and `<!-- /rlflow:NAME -->`; everything
between them is rewritten, everything around them is prose kept by hand. Refresh the pages after changing the CLI,
the schema or the invalid-pipeline catalogue (tests/unit/repo/test_docs.py fails until you do):

    python docs/reference_pages.py           # rewrite the stale pages
    python docs/reference_pages.py --check   # list them and exit 1, writing nothing
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "docs" / "reference"
CATALOGUE = REPO / "tests" / "compile" / "invalid"
REFRESH = "python docs/reference_pages.py"


def _cell(text) -> str:
    """Text safe inside one markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


@cache
def cli_markdown() -> str:
    """Each command's help as click formats it (plain text, 110 columns: a stable page), from the typer app."""
    import typer
    import typer._click as click

    from rlflow.cli import app

    group = typer.main.get_command(app)
    width = {"terminal_width": 110, "max_content_width": 110, "help_option_names": ["-h", "--help"]}
    root = click.Context(group, info_name="rlflow", **width)
    out = []
    for name, command in group.commands.items():
        ctx = click.Context(command, info_name=name, parent=root, **width)
        formatter = ctx.make_formatter()
        click.Command.format_help(command, ctx, formatter)  # click's plain layout, not typer's rich panels
        out += [f"### `rlflow {name}`", "", _cell(command.get_short_help_str(limit=300)), "", "```text",
                formatter.getvalue().rstrip(), "```", ""]
    return "\n".join(out)


def _type(prop: dict) -> str:
    """A JSON Schema property's type, short: `int`, `[Barrier](#barrier) \\| ...`, `list[str]`."""
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in prop:
            return " or ".join(_type(p) for p in prop[key])
    if "const" in prop:
        return f"`{json.dumps(prop['const'])}`"
    if "enum" in prop:
        return " or ".join(f"`{json.dumps(v)}`" for v in prop["enum"])
    kind = prop.get("type", "any")
    if kind == "array":
        return f"list of {_type(prop.get('items', {}))}"
    if kind == "object" and isinstance(prop.get("additionalProperties"), dict):
        return f"map of name to {_type(prop['additionalProperties'])}"
    return {"integer": "int", "number": "float", "string": "str", "boolean": "bool"}.get(kind, kind)


def _model(title: str, schema: dict) -> list[str]:
    """One model of the schema: its heading, its docstring and a table of its fields."""
    out = [f"### {title}", "", schema.get("description", "").strip(), ""]
    props = schema.get("properties", {})
    if props:
        required = set(schema.get("required", []))
        out += ["| field | type | default | what it is |", "|---|---|---|---|"]
        for name, prop in props.items():
            default = "required" if name in required else (f"`{json.dumps(prop['default'])}`" if "default" in prop else "")
            out.append(f"| `{name}` | {_cell(_type(prop))} | {_cell(default)} | {_cell(prop.get('description', ''))} |")
        out.append("")
    return out


@cache
def schema_markdown() -> str:
    """The JSON Schema `rlflow schema` prints, as one table per model, then the built-in component names."""
    from rlflow.cli import main

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main(["schema"]) == 0
    schema = json.loads(text.getvalue())
    out = ["## The pipeline", ""] + _model("Pipeline", schema)[2:]
    out += ["## Every model it refers to", ""]
    for title, model in sorted(schema["$defs"].items()):
        out += _model(title, model)
    builtins = schema.get("x-rlflow-builtins", {})
    if builtins:
        out += ["## Built-in components", "", "Names a pipeline may use without an import string.", "",
                "| category | built-in names |", "|---|---|"]
        out += [f"| {c} | {_cell(', '.join(f'`{n}`' for n in names))} |" for c, names in builtins.items()]
    return "\n".join(out)


def _entry_link(stem: str) -> str:
    anchor = stem.replace("_", "-")
    return f"[{stem}](#{anchor})"


@cache
def errors_markdown() -> str:
    """The catalogue of invalid pipelines in tests/compile/invalid/, each validated here for the rules it breaks."""
    from rlflow.cli import main

    rows = []
    for path in sorted(CATALOGUE.glob("*.yaml")):
        lines = path.read_text().splitlines()
        what = next((ln.removeprefix("# invalid:").strip() for ln in lines if ln.startswith("# invalid:")), "")
        expects = [ln.removeprefix("# expect: ") for ln in lines if ln.startswith("# expect: ")]
        gpus = [ln.removeprefix("# gpus: ") for ln in lines if ln.startswith("# gpus: ")]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            main(["validate", str(path), *(["--gpus", gpus[0]] if gpus else [])])
        rules = sorted(set(re.findall(r"\[([a-z0-9-]+)\]$", err.getvalue(), re.MULTILINE)))
        rows.append((path.stem, what, rules, expects))
    by_rule: dict[str, list[str]] = {}
    for stem, _, rules, _ in rows:
        for rule in rules:
            by_rule.setdefault(rule, []).append(stem)
    out = [f"{len(rows)} invalid pipelines break {len(by_rule)} rules.", "", "### By rule", "",
           "| rule | catalogue entries |", "|---|---|"]
    out += [f"| `{r}` | {', '.join(_entry_link(s) for s in stems)} |" for r, stems in sorted(by_rule.items())]
    out += ["", "### By entry", ""]
    for stem, what, rules, expects in rows:
        out += [f"#### {stem.replace('_', '-')}", "", f"`tests/compile/invalid/{stem}.yaml`: {what}", "",
                "Rules: " + (", ".join(f"`{r}`" for r in rules) or "none reported"), ""]
        out += [f"- expects: `{e}`" if "`" not in e else f"- expects: {e}" for e in expects] + [""]
    return "\n".join(out)


# block name -> (the page that holds it, what writes it)
BLOCKS: dict[str, tuple[Path, Callable[[], str]]] = {
    "cli": (REFERENCE / "cli.md", cli_markdown),
    "schema": (REFERENCE / "schema.md", schema_markdown),
    "errors": (REFERENCE / "errors.md", errors_markdown),
}


def fill(text: str, name: str, body: str) -> str:
    """`text` with the block `name` holding `body`: the markers stay, what was between them is replaced."""
    start, end = f"<!-- rlflow:{name} -->", f"<!-- /rlflow:{name} -->"
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"the page must hold {start} once, then {end} once: the generated text goes between them")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    note = f"<!-- generated by `{REFRESH}`: edit the code it reads, not this text -->"
    return f"{head}{start}\n{note}\n\n{body.strip()}\n\n{end}{tail}"


def regenerated(page: Path) -> str:
    """The page as it should read: every block it holds filled from the code as it is now."""
    text = page.read_text()
    for name, (where, make) in BLOCKS.items():
        if where == page:
            text = fill(text, name, make())
    return text


def stale_pages() -> dict[Path, str]:
    """The reference pages whose generated text differs from what the code gives now, each with the text it should
    hold (regenerating the errors page validates every catalogue pipeline: done once, not again to write it)."""
    pages = sorted({page for page, _ in BLOCKS.values()})
    fresh = {page: regenerated(page) for page in pages}
    return {page: text for page, text in fresh.items() if text != page.read_text()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="list the stale pages and exit 1; write nothing")
    args = parser.parse_args(argv)
    stale = stale_pages()
    for page, text in stale.items():
        if args.check:
            print(f"stale: {page.relative_to(REPO)}")
        else:
            page.write_text(text)
            print(f"rewrote {page.relative_to(REPO)}")
    if args.check and stale:
        print(f"run `{REFRESH}` to refresh them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
