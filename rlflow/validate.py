"""Document -> validated Pipeline, with pydantic's errors turned into Problems a person can act on.

`validate_partial` also gives a best-effort Pipeline when the schema has problems, so the graph and
component rules still run and `rlflow validate` reports every problem of a file at once.
"""

from __future__ import annotations

import copy
import re
import types
from typing import Annotated, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from rlflow.errors import PipelineInvalid, Problem, did_you_mean
from rlflow.loader import Document
from rlflow.peer_names import suggest
from rlflow.schema import Pipeline


def validate(doc: Document) -> Pipeline:
    """The typed pipeline, or PipelineInvalid listing every schema problem."""
    try:
        return Pipeline.model_validate(doc.data)
    except ValidationError as e:
        problems = [doc.locate(_problem(err, doc)) for err in e.errors(include_url=False)]
        raise PipelineInvalid(doc.source, problems) from None


class Repairs:
    """The values dropped from a document so that the rest validates; says which later problems echo them."""

    def __init__(self):
        self.locs: list[tuple] = []  # dropped unknown fields and bad values
        self.fields: set[str] = set()  # names of the fields whose bad value was replaced by the default

    def echoes(self, problem: Problem) -> bool:
        """A graph problem at or under a dropped value, or naming a field whose value was bad (a rule that read
        the stand-in default, e.g. no-room-for-prompt after a bad model.max_model_len): it would mislead."""
        if any(tuple(problem.loc[:len(loc)]) == loc for loc in self.locs):
            return True
        words = set(re.findall(r"[A-Za-z_]+", f"{problem.message} {problem.fix}"))
        return bool(self.fields & words)


def validate_partial(doc: Document) -> tuple[Pipeline | None, list[Problem], Repairs]:
    """(pipeline, schema problems, repairs).

    Without schema problems: the pipeline, [], no repairs. With them: each unknown field, and each bad
    value of a field that has a default, is dropped from a copy of the document; if that copy
    validates, it is returned, so the graph and component rules still run (drop the problems that
    `repairs.echoes`); else None: a required part is wrong and the graph cannot be built faithfully.
    """
    repairs = Repairs()
    try:
        return Pipeline.model_validate(doc.data), [], repairs
    except ValidationError as e:
        errors = e.errors(include_url=False)
    problems = [doc.locate(_problem(err, doc)) for err in errors]
    data = copy.deepcopy(doc.data)
    for err in errors:
        loc = _clean_loc(tuple(err["loc"]), doc.data)
        if not _removable(err, loc, doc.data):
            return None, problems, repairs
        repairs.locs.append(loc)
        if err["type"] != "extra_forbidden" and isinstance(loc[-1], str):
            repairs.fields.add(loc[-1])
    for loc in sorted(set(repairs.locs), key=len, reverse=True):
        parent = data
        for part in loc[:-1]:
            parent = parent[part]
        parent.pop(loc[-1], None)
    try:
        return Pipeline.model_validate(data), problems, repairs
    except ValidationError:
        return None, problems, repairs


def _removable(err: dict, loc: tuple, data) -> bool:
    """Whether the value at `loc` may be dropped: an unknown field, or a bad value of a field with a default."""
    if not loc or err["type"] in ("missing", "union_tag_invalid", "union_tag_not_found"):
        return False
    parent = data
    for part in loc[:-1]:
        parent = _child(parent, part)
    if not isinstance(parent, dict) or loc[-1] not in parent:
        return False
    owner, field = _field_at(loc, data)
    if err["type"] == "extra_forbidden":
        return owner is not None
    return field is not None and not field.is_required()


def _clean_loc(loc: tuple, data) -> tuple:
    """Drop pydantic's discriminator tags from a loc: ('stages','t','train','lr') -> ('stages','t','lr')."""
    out, node = [], data
    for part in loc:
        if isinstance(node, dict) and part in node or isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(node, dict) and node.get("kind") == part:
            continue  # the tagged-union branch name, not a key in the document
        else:
            node = None
        out.append(part)
    return tuple(out)


def _unwrap(tp, node):
    """The BaseModel class a value of type `tp` validates against (a union picks by the value's `kind`)."""
    tp = _strip(tp)
    if get_origin(tp) in (Union, types.UnionType):
        kind = node.get("kind") if isinstance(node, dict) else None
        for option in get_args(tp):
            kinds = get_args(option.model_fields["kind"].annotation) if "kind" in getattr(option, "model_fields", {}) else ()
            if kind in kinds:
                return option
        return None
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _child(node, key):
    if isinstance(node, dict):
        return node.get(key)
    if isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
        return node[key]
    return None


def _field_at(loc: tuple, data):
    """(model class owning the last part of `loc`, its FieldInfo), walking the schema alongside the data."""
    cls, node, i = Pipeline, data, 0
    while i < len(loc) and cls is not None:
        field = _field(cls, loc[i])
        if field is None or i == len(loc) - 1:
            return cls, field
        node = _child(node, loc[i])
        tp = _strip(field.annotation)
        if get_origin(tp) in (dict, list):  # the next part is a key or an index
            i += 1
            node = _child(node, loc[i])
            if i == len(loc) - 1:
                return None, None
            tp = get_args(tp)[-1]
        cls = _unwrap(tp, node)
        i += 1
    return None, None


def _strip(tp):
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _strip(args[0])
    return tp


def _field(cls, name):
    for fname, f in cls.model_fields.items():
        if name in (fname, f.alias):
            return f
    return None


def _fields_of(cls) -> list[str]:
    return [f.alias or n for n, f in cls.model_fields.items()]


def _problem(err: dict, doc: Document) -> Problem:
    loc = _clean_loc(tuple(err["loc"]), doc.data)
    typ, ctx, value = err["type"], err.get("ctx", {}), err.get("input")
    name = loc[-1] if loc else "pipeline"
    owner, field = _field_at(loc, doc.data) if loc else (None, None)
    help_ = f"{name}: {' '.join(field.description.split())}" if field is not None and field.description else ""  # one line
    line = doc.line_of(loc)

    if typ == "extra_forbidden":
        allowed = _fields_of(owner) if owner else []
        hint, fix = suggest(name, owner, allowed, doc.data)  # TRL's, verl's and OpenRLHF's names first (rlflow/peer_names.py)
        return Problem(loc, f"unknown field '{name}'{hint}", "unknown-field",
                       fix or ("fields allowed here: " + ", ".join(allowed) if allowed else "remove it"), line)
    if typ == "missing":
        return Problem(loc, f"required field '{name}' is missing", "missing-field", help_ or "add it", line)
    if typ == "union_tag_invalid":
        tags = ctx.get("expected_tags", "")
        what = "stage" if loc and loc[0] == "stages" else "policy"
        return Problem(loc + ("kind",), f"unknown {what} kind '{ctx.get('tag')}'{did_you_mean(ctx.get('tag'), tags.replace(chr(39), '').split(', '))}",
                       f"unknown-{what}-kind", f"kind must be one of: {tags.replace(chr(39), '')}", line)
    if typ == "union_tag_not_found":
        what = "stage" if loc and loc[0] == "stages" else "policy"
        return Problem(loc, f"this {what} has no 'kind'", "missing-kind", "add kind: (see `rlflow schema`)", line)
    if typ in ("int_parsing", "int_from_float", "int_type"):
        return Problem(loc, f"'{name}' must be an integer, got {value!r}", "not-an-integer", help_, line)
    if typ in ("float_parsing", "float_type"):
        return Problem(loc, f"'{name}' must be a number, got {value!r}", "not-a-number", help_, line)
    if typ in ("bool_parsing", "bool_type"):
        return Problem(loc, f"'{name}' must be true or false, got {value!r}", "not-a-bool", help_, line)
    if typ in ("string_type",):
        return Problem(loc, f"'{name}' must be a string, got {type(value).__name__} {value!r}", "not-a-string", help_, line)
    if typ in ("dict_type", "model_type", "model_attributes_type"):
        return Problem(loc, f"'{name}' must be a mapping, got {type(value).__name__}", "not-a-mapping", help_, line)
    if typ in ("list_type",):
        return Problem(loc, f"'{name}' must be a list, got {type(value).__name__}", "not-a-list", help_, line)
    if typ == "literal_error":
        expected = ctx.get("expected", "")
        return Problem(loc, f"'{name}' is {value!r}{did_you_mean(value, [x.strip(' ' + chr(39)) for x in expected.replace(' or ', ', ').split(',')])}",
                       "bad-choice", f"must be {expected}", line)
    if typ in ("greater_than_equal", "greater_than", "less_than", "less_than_equal"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than": "<", "less_than_equal": "<="}[typ]
        bound = next(iter(ctx.values()))
        bound = f"{bound:g}" if isinstance(bound, float) else bound
        return Problem(loc, f"'{name}' must be {op} {bound}, got {value!r}", "out-of-range", help_, line)
    if typ in ("too_short",):
        return Problem(loc, f"'{name}' is empty", "empty", help_, line)
    if typ == "string_pattern_mismatch":
        return Problem(loc, f"'{name}' is {value!r}, which has characters not allowed", "bad-name", help_, line)
    msg = err["msg"][0].lower() + err["msg"][1:]
    return Problem(loc, f"'{name}': {msg}", typ.replace("_", "-"), help_, line)

