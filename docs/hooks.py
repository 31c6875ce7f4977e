"""mkdocs hook: the reference pages are generated from the code at every build, so they never go stale.

A page holds a marker where generated text goes: `<!-- rlflow:cli -->` (the typer app behind `rlflow`),
`<!-- rlflow:schema -->` (the JSON Schema `rlflow schema` prints), `<!-- rlflow:errors -->` (the catalogue of
invalid pipelines in tests/compile/invalid/, each validated here for the rules it breaks). The results pages
include benchmarks/results/*.md through pymdownx.snippets; this hook also publishes the plots beside them.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from functools import cache
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
CATALOGUE = REPO / "tests" / "compile" / "invalid"


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


GENERATED = {"<!-- rlflow:cli -->": cli_markdown, "<!-- rlflow:schema -->": schema_markdown,
             "<!-- rlflow:errors -->": errors_markdown}


def on_page_markdown(markdown: str, page, config, files) -> str:
    for marker, make in GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown


def on_files(files, config):
    """The plots the benchmarks write beside their tables, published under results/."""
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/{png.name}", content=png.read_bytes()))
    return files
