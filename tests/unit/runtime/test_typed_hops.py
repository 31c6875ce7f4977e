"""Hand-offs across a Ray call are typed (STYLE.md "Hand-offs are typed"): no runtime module passes a tuple or dict
literal (or a tuple(...) / dict(...) call) as an argument of a `.remote(...)` call, so a new untyped hop fails here
and gets a message class in rlflow/runtime/messages.py instead. The hops that stay untyped are named below, each
with the reason it stays."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).parents[3] / "rlflow" / "runtime"

#: (module, the function the call is in) -> why an untyped argument of a .remote call stays there
ALLOWED: dict[tuple[str, str], str] = {
    ("agent_gateway.py", "start_gateway"): "the agent's settings, the plan's own JSON (stages.<rollout>.agent) with "
                                           "max_turns added, for the gateway's constructor",
    ("reward_stream.py", "RewardStream.__init__"): "the StreamHost's constructor keywords, passed whole to the "
                                                   "StreamRunner it builds (one process hop, not a message)",
    ("rollout_fleet.py", "RolloutFleet._spawn"): "threads=(count, share): the thread cap RolloutWorker hands to "
                                                 "actor_threads, a pair of numbers, not a message",
    ("weight_link.py", "open_link"): "the (host, port) address of a TCP store, the form torch.distributed takes",
}


def untyped_hops(source: str, module: str = "<snippet>") -> list[tuple[str, str, int]]:
    """(module, enclosing function, line) of each `.remote(...)` call in `source` that is given a tuple or dict
    literal, or a tuple(...) / dict(...) call, as an argument (positional or keyword). `ray.remote(...)` declares an
    actor's options, no message: it is not a hop."""
    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, f"{where}.{child.name}" if where else child.name)
                continue
            if isinstance(child, ast.Call) and _is_hop(child):
                args = [*child.args, *(k.value for k in child.keywords)]
                if any(_untyped(a) for a in args):
                    found.append((module, where or "<module>", child.lineno))
            visit(child, where)

    visit(ast.parse(source), "")
    return found


def _is_hop(call: ast.Call) -> bool:
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr == "remote"):
        return False
    return not (isinstance(func.value, ast.Name) and func.value.id == "ray")  # @ray.remote(...): actor options


def _untyped(arg: ast.expr) -> bool:
    if isinstance(arg, ast.Starred):
        arg = arg.value
    if isinstance(arg, ast.Tuple | ast.Dict):
        return True
    return isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name) and arg.func.id in ("tuple", "dict")


def runtime_hops() -> list[tuple[str, str, int]]:
    return [hop for path in sorted(RUNTIME.glob("*.py")) for hop in untyped_hops(path.read_text(), path.name)]


def test_no_runtime_module_adds_an_untyped_hop():
    new = [f"{m}:{line} in {fn}" for m, fn, line in runtime_hops() if (m, fn) not in ALLOWED]
    assert not new, ("a tuple or dict crosses a Ray call; give it a message class in rlflow/runtime/messages.py "
                     f"(or, if it must stay, a reason in ALLOWED): {', '.join(new)}")


def test_every_allowed_hop_still_exists():
    """An exception whose call is gone (or was typed) leaves the list, so the list stays the truth."""
    present = {(m, fn) for m, fn, _ in runtime_hops()}
    assert set(ALLOWED) <= present, f"no longer untyped, remove from ALLOWED: {sorted(set(ALLOWED) - present)}"


@pytest.mark.parametrize("source", [
    "h.step.remote(('step', fleet, inst))",
    "h.step.remote(x, {'version': 3})",
    "h.step.remote(x, report=dict(version=3))",
    "h.step.remote(*tuple(ids))",
    "class A:\n    def go(self):\n        self.h.options(num_cpus=1).remote(1, meta=(a, b))",
])
def test_an_untyped_argument_of_a_remote_call_is_found(source):
    (hop,) = untyped_hops(source)
    assert hop[0] == "<snippet>" and hop[2] == source.count("\n") + 1


def test_typed_arguments_and_actor_options_are_not_hops():
    source = ("h.train.remote(TrainStep(rewards, 8, 3))\nh.step.remote(routes, [1, 2], pull=None)\n"
              "A = ray.remote(num_cpus=0, concurrency_groups={'links': 64})(B)\nf((1, 2))\n")
    assert untyped_hops(source) == []


def test_the_enclosing_function_is_named():
    source = "class Fleet:\n    def send(self):\n        def inner():\n            h.remote((1, 2))\n"
    assert untyped_hops(source, "m.py") == [("m.py", "Fleet.send.inner", 4)]


# ------------------------------------------------------------------------------------------ the driver's side
def test_the_driver_matches_each_run_event_to_its_receiver():
    """Run._handle sends each event of messages.RunEvent to its receiver; only training progress feeds the
    watchdog, and an object that is no run event is a bug, said as one (not silently dropped)."""
    from concurrent.futures import Future

    from rlflow.runtime.driver import Run
    from rlflow.runtime.messages import Evaluated, Joined, ScoredBatch, StepDone, Trained

    def done(value=None, error=None) -> Future:
        """A finished call's future, as Run._submit puts it in the event."""
        fut = Future()
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
        return fut

    calls = []

    class Fleet:
        def on_joined(self, inst, error):
            calls.append(("joined", inst, str(error)))

        def on_step(self, inst, report):
            calls.append(("step", inst, report))

    class Sink:
        ref = object()

    run = Run.__new__(Run)
    run.watchdog = type("W", (), {"fed": lambda self: calls.append("fed")})()
    run.ledger = type("L", (), {"flush": lambda self: calls.append("flush")})()
    run.evals = type("E", (), {"result": lambda self, step, fut: fut.result()})()
    run._on_eval = lambda step, result: calls.append(("eval", step, result))
    run._on_trained = lambda trained: calls.append(("trained", trained))
    run.sink, fleet = Sink(), Fleet()

    run._handle(None)
    run._handle(Evaluated(4, done({"eval/accuracy": 0.5})))
    run._handle(Joined(fleet, "i1", done(error=RuntimeError("no GPU"))))
    assert calls == [("eval", 4, {"eval/accuracy": 0.5}), ("joined", "i1", "no GPU")]  # no progress: not fed
    calls.clear()
    run._handle(StepDone(fleet, "i0", done("report")))
    run._handle(Trained(done("result")))
    assert calls == ["fed", ("step", "i0", "report"), "flush", "fed", ("trained", "result"), "flush"]
    with pytest.raises(TypeError, match="no handler for the event"):
        run._handle(("rewarded", "score", ScoredBatch([])))  # the old tuple form
