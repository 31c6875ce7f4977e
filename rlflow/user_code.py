"""User code named by import strings (`fn: mypkg.rewards:exact`): where it is found, and whether it fits.

Where: a module beside the pipeline file or in the working directory is found at compile without
PYTHONPATH (`importable_from`); the plan records the directories the named modules came from
(plan["python_path"], `python_path`), for the runtime to put on every worker's path.

Whether it fits, by signature, at compile (rule `not-a-<category>`), so a run does not die minutes in:
- a reward is called fn(completion, answer), with prompt= and row= only when its signature takes
  them by name or through **kwargs (the runtime's rlflow/runtime/reward_call.py reward_caller); one that names
  batch parameters (prompts, completions: TRL's reward_funcs style) is refused even where it would bind;
- a filter is called fn(rewards) with one list of a group's rewards;
- a ranker is called with no arguments and gives an object with predict(prompts) and observe(prompts, lengths);
- an env is a class that subclasses rlflow.stages.environment.Environment and implements step (one instance per
  trajectory, made with the stage's env_kwargs).
Classes are not rewards or filters, and nothing from the Python standard library or the builtins is a
reward, filter or ranker (`subprocess:run`, `os:system`, `builtins:len` fit some signatures, and would
run a command or score nonsense): write your own function, which may call them.

Where it broke, once it no longer imports or fits (`described`: 'path:line: why'), for the `user-code-error` of a
run whose user code changed since compile (rlflow/runtime/user_code_check.py, and a reward process mid-run).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import inspect
import sys
import sysconfig
from pathlib import Path

#: directories searched for user modules beyond sys.path while `importable_from` is active
SEARCHED: list[tuple[str, Path]] = []

REWARD_EXTRAS = ("prompt", "row")  # keywords the runtime passes to a reward that takes them


def search_dirs(base_dir: Path) -> list[tuple[str, Path]]:
    """(what, directory) pairs searched for user modules: beside the pipeline, then the working directory."""
    out: list[tuple[str, Path]] = []
    for what, d in (("beside the pipeline", base_dir), ("in the working directory", Path.cwd())):
        d = Path(d).resolve()
        if all(d != seen for _, seen in out):
            out.append((what, d))
    return out


@contextlib.contextmanager
def importable_from(base_dir: Path, also: list[str] = ()):
    """Put the pipeline's directory and the working directory in front of sys.path, as Python does for a script;
    `also`: more directories after them (a run's plan python_path, for `rlflow eval` of its export)."""
    dirs = search_dirs(base_dir)
    dirs += [("where the run found its user code", Path(d).resolve()) for d in also
             if all(Path(d).resolve() != seen for _, seen in dirs)]
    added = [str(d) for _, d in dirs if str(d) not in sys.path]
    sys.path[:0] = added
    importlib.invalidate_caches()  # a module written since the last import (a test, an editor) is seen
    SEARCHED[:] = dirs
    try:
        yield dirs
    finally:
        for d in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(d)
        SEARCHED.clear()


def not_found_help(module_name: str) -> str:
    """Where a missing module was looked for, and the fix."""
    where = ", ".join(f"{what} ({d})" for what, d in SEARCHED)
    first = module_name.split(".")[0]
    looked = f"looked {where} and in the installed packages" if where else "looked in the installed packages"
    return (f"{looked}; put {first}.py (or the package {first}/) beside the pipeline file, "
            f"or set PYTHONPATH to the directory that holds it, or pip install it")


def python_path(refs: list[str], dirs: list[tuple[str, Path]]) -> list[str]:
    """The directories of `dirs` that the (already imported) modules of import strings `refs` came from
    and that Python would not find without them (an installed or editable package needs none)."""
    out: list[str] = []
    for ref in refs:
        name = ref.partition(":")[0].split(".")[0]
        top = sys.modules.get(name)
        root = _root_dir(top) if top is not None else None
        for _, d in dirs:
            if root == d and str(d) not in out and not _found_without(name, [d for _, d in dirs]):
                out.append(str(d))
    return out


def _found_without(name: str, dirs: list[Path]) -> bool:
    """Whether top-level module `name` is importable with `dirs` (and the working directory) off the path."""
    path = [p for p in sys.path if p and _resolved(p) not in dirs]
    for finder in sys.meta_path:
        try:
            if finder is importlib.machinery.PathFinder:
                spec = finder.find_spec(name, path)
            else:
                spec = finder.find_spec(name, None) if hasattr(finder, "find_spec") else None
        except Exception:  # noqa: BLE001 - a third-party finder that fails does not find it
            spec = None
        if spec is not None:
            return True
    return False


def _resolved(entry: str) -> Path | None:
    try:
        return Path(entry).resolve()
    except (OSError, RuntimeError):
        return None


def _root_dir(module) -> Path | None:
    """The sys.path entry a top-level module was imported from."""
    file = getattr(module, "__file__", None)
    if file:
        here = Path(file).resolve().parent
        return here.parent if hasattr(module, "__path__") else here  # a package: its directory's parent
    locations = list(getattr(module, "__path__", []) or [])  # a namespace package
    return Path(locations[0]).resolve().parent if locations else None


def _is_stdlib(module_name: str | None) -> bool:
    if not module_name:
        return False
    top = module_name.split(".")[0]
    if top in sys.builtin_module_names or top == "builtins":
        return True
    module = sys.modules.get(module_name) or sys.modules.get(top)
    file = getattr(module, "__file__", None)
    if not file:
        return top in getattr(sys, "stdlib_module_names", ())
    path = Path(file).resolve()
    if {"site-packages", "dist-packages"} & set(path.parts):
        return False
    roots = {Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")}
    return any(path.is_relative_to(r) for r in roots)


def _described(obj) -> str:
    if inspect.isclass(obj):
        return f"class {obj.__name__}"
    if inspect.isbuiltin(obj):
        return f"built-in function {obj.__name__}"
    if inspect.isfunction(obj) or inspect.ismethod(obj):
        return f"function {obj.__name__}"
    if callable(obj):
        return f"a callable {type(obj).__name__} object"
    return f"a {type(obj).__name__} value, not callable"


def _signature(obj):
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def _reward_call(sig: inspect.Signature) -> tuple[tuple, dict]:
    """The arguments the runtime passes (rlflow/runtime/reward_call.py reward_caller: same rule)."""
    params = sig.parameters.values()
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params)
    return ("completion", "answer"), {k: None for k in REWARD_EXTRAS if takes_any or k in names}


#: parameter names of a reward that scores a batch (TRL's GRPOTrainer calls reward_funcs(prompts=, completions=,
#: completion_ids=, **dataset columns) and takes a list back): an rlflow reward scores one completion
BATCH_PARAMS = ("prompts", "completions", "completion_ids", "answers")


def _batch_params(sig: inspect.Signature) -> list[str]:
    """The batch-style parameters a reward's signature names (plural names that take lists), in order."""
    return [p.name for p in sig.parameters.values()
            if p.name in BATCH_PARAMS and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


SHAPES = {
    "reward": ("fn(completion, answer) -> float (optionally also prompt=, row= or **kwargs)",
               "e.g. def score(completion, answer): return float(completion.strip() == answer); built-ins: exact_match, numeric_close"),
    "filter": ("fn(rewards) -> bool, called with one list of a group's rewards",
               "e.g. def keep(rewards): return len(set(rewards)) > 1; built-in: drop_uniform_groups"),
    "ranker": ("a class (or factory) called with no arguments, whose objects have predict(prompts) and observe(prompts, lengths)",
               "see rlflow.operators.length_ranker.OnlineLengthRanker; built-in: learned"),
    "env": ("a class that subclasses rlflow.stages.environment.Environment and implements step(action) -> EnvStep",
            ("e.g. class Echo(Environment): def step(self, action): return EnvStep(observation='ok'); "
             "built-ins: calculator, python")),
}


def _env_misfit(what: str, obj, shape: str, example: str) -> str | None:
    """Why `obj` cannot serve as an environment class (the rollout worker calls env_cls(**env_kwargs) per
    trajectory, then reset and step), or None."""
    from rlflow.stages.environment import Environment

    if not inspect.isclass(obj):
        return f"{what}, not a class; an env is {shape}; {example}"
    if not issubclass(obj, Environment):
        return (f"{what}, which does not subclass Environment; an env is {shape}; add the base class: "
                f"class {obj.__name__}(Environment), from rlflow.stages.environment import Environment, EnvStep")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ()))) or "step"
        return f"{what}, which does not implement {missing}; an env is {shape}; {example}"
    return None


def misfit(category: str, ref: str, obj) -> str | None:
    """Why `obj` (named by import string `ref`) cannot serve as a `category`, as 'message; way out', or None."""
    if category not in SHAPES:
        return None
    shape, example = SHAPES[category]
    what = f"'{ref}' is {_described(obj)}"
    if category == "env":
        return _env_misfit(what, obj, shape, example)
    module = getattr(obj, "__module__", None) or ref.partition(":")[0]
    if _is_stdlib(ref.partition(":")[0]) or _is_stdlib(module):
        where = ref.partition(":")[0] if _is_stdlib(ref.partition(":")[0]) else module
        return (f"{what} from the Python standard library ({where}), not a {category}: a {category} is {shape}; "
                f"write your own, {example}")
    if not callable(obj):
        return f"{what}; a {category} is {shape}; {example}"
    if inspect.isclass(obj) and category != "ranker":
        return f"{what}; a {category} is a function {shape}; {example}"
    sig = _signature(obj)
    if sig is None:
        return f"{what}, whose signature Python cannot read; a {category} is {shape}; wrap it in a def, {example}"
    if category == "reward" and (batch := _batch_params(sig)):
        return (f"{what}{sig}, a batch reward ({', '.join(batch)}: lists in, a list of floats out, TRL's reward_funcs "
                f"style), which rlflow would call with one completion and score nonsense; a reward is {shape}; rewrite "
                f"it per completion, or wrap it: def score(completion, answer, prompt=None): return "
                f"{getattr(obj, '__name__', 'fn')}([prompt], [completion], answer=[answer])[0]")
    args, kwargs = {"reward": _reward_call(sig), "filter": (([0.0, 1.0],), {}), "ranker": ((), {})}[category]
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        return f"{what}{sig} and cannot be called as {category} ({e}); a {category} is {shape}; {example}"
    if category == "ranker" and inspect.isclass(obj):
        missing = [m for m in ("predict", "observe") if not callable(getattr(obj, m, None))]
        if missing:
            return f"{what} without {' and '.join(missing)}(); a ranker is {shape}; {example}"
    return None


# ------------------------------------------------------------------------------------------ where it broke
def _users_file(filename: str) -> bool:
    """Whether a traceback's file is the user's own (not rlflow's, Python's, an installed package's or frozen)."""
    if filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    if {"site-packages", "dist-packages"} & set(path.parts):
        return False
    rlflow_root = Path(__file__).resolve().parents[1]  # the checkout (or site-packages) that holds rlflow/, stages/
    if any(path.is_relative_to(rlflow_root / d) for d in ("rlflow", "stages", "operators")):
        return False
    roots = {Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")}
    return not any(path.is_relative_to(r) for r in roots)


def innermost(err: BaseException) -> BaseException:
    """The first error of `err`'s chain: registry's ComponentError and a tool's ToolError are raised from (or while
    handling) the import's own error."""
    seen = {id(err)}
    while (inner := err.__cause__ or err.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        err = inner
    return err


def broke_at(err: BaseException) -> str | None:
    """'path:line' where user code failed, from what importing or checking it raised (`innermost`): a SyntaxError's
    file and line, else the deepest frame of the user's own code. None when nothing points there."""
    err = innermost(err)
    if isinstance(err, SyntaxError) and err.filename:
        return f"{err.filename}:{err.lineno}" if err.lineno else err.filename
    import traceback

    frames = [f for f in traceback.extract_tb(err.__traceback__) if _users_file(f.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def located(err: BaseException, why: str) -> str:
    """`why` (one line about `err`) as 'path:line: why' when `broke_at` finds the place (a SyntaxError's own
    '(file.py, line N)' then goes: said once)."""
    where = broke_at(err)
    if where is None:
        return why
    inner = innermost(err)
    if isinstance(inner, SyntaxError) and inner.filename:
        why = why.replace(f" ({Path(inner.filename).name}, line {inner.lineno})", "")
    return f"{where}: {why}"


def defined_at(obj) -> str | None:
    """'path:line' of a function's or class's definition (a signature that does not fit), else its module's file."""
    target = inspect.unwrap(obj) if callable(obj) else obj
    try:
        return f"{inspect.getsourcefile(target)}:{inspect.getsourcelines(target)[1]}"
    except (TypeError, OSError):
        return getattr(sys.modules.get(getattr(obj, "__module__", "") or ""), "__file__", None)


def described(err: Exception, ref: str) -> str:
    """One line on why user code named by `ref` cannot be used, from the ComponentError (or ToolError) it raised:
    'path:line: why', the place being where its import broke, else where the object is defined."""
    why = (str(err).splitlines() or [""])[0].partition("; ")[0]
    if broke_at(err) is not None:
        return located(err, why)
    where = _defined(ref)  # it imports, but does not fit its call (or lacks the attribute)
    return f"{where}: {why}" if where else why


def _defined(ref: str) -> str | None:
    """Where the object a reference names is defined (it imported, but does not fit its call), else the file of its
    module (it lacks the attribute), else None. `ref`: module:attr, or an adapter's library:module:attr."""
    module_name, _, attr = ref.rpartition(":")
    module = sys.modules.get(module_name.rpartition(":")[2])  # imported by the check that refused it
    if module is None:
        return None
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return getattr(module, "__file__", None)
    return defined_at(obj)
