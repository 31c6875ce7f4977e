"""An agent through the OpenAI-compatible endpoint against the same task as a native chat-form tools stage (issue 48).

    python benchmarks/bench_agent_endpoint.py [--steps 12] [--repeats 2]

The same task, model and settings both ways: builtin:calc on builtin:tiny-llama's chat-form tool build, the calculator
offered as a tool, Hermes calls, up to 3 turns, η = 2. Native: pipelines/agentic_tools.yaml (rlflow runs the tool
between turns inside the rollout worker). Agent: pipelines/agentic_openai.yaml (a plain-`openai` agent,
rlflow/stages/openai_calc_agent.py, sends each request to the endpoint, runs the tool itself and sends the result
back). Each runs `--repeats` times, alternating, with `rlflow compile && rlflow run` in a scratch directory
(bench_learning.py's harness; held-out evaluation off). Figures: trained episodes per second over steps 2..N (the
first step carries start-up), the engine's generated tokens per second, turns per episode, the final reward. Goal:
the agent stage at 0.8x of native or better. Writes benchmarks/results/agent_endpoint.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "agent_endpoint.md"
PIPELINES = {"native tools stage (agentic_tools)": "agentic_tools", "agent via the endpoint (agentic_openai)":
             "agentic_openai"}


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    harness, agentic = _module("bench_learning"), _module("bench_agentic")
    run_args = argparse.Namespace(steps=args.steps, sync_redundancy=0, set=["data.eval=null", "tracking.progress=false"])
    runs: dict[str, list[dict]] = {label: [] for label in PIPELINES}
    with tempfile.TemporaryDirectory(prefix="bench-agent-endpoint-") as scratch:
        for i in range(args.repeats):  # alternating: a drift of the machine falls on both alike
            for label, name in PIPELINES.items():
                result = harness.run(name, "2", run_args, Path(scratch), label=f"{i}")
                runs[label].append(agentic.measure(result, Path(scratch) / f"{name}-{i}"))  # steps 2..N, as there

    def mean(label: str, key: str) -> float:
        return sum(r[key] for r in runs[label]) / len(runs[label])

    native = next(iter(PIPELINES))
    lines = ["| rollout | trained episodes/s (steps 2..N) | vs native | generated tokens/s (engine) | vs native "
             "| turns per episode | final reward |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label in PIPELINES:
        eps, tok = mean(label, "episodes_per_s"), mean(label, "rollout_tokens_per_s")
        spread = ", ".join(f"{r['episodes_per_s']:.1f}" for r in runs[label])
        lines.append(f"| {label} | {eps:.1f} ({spread}) | {eps / mean(native, 'episodes_per_s'):.2f}x | {tok:,.0f} | "
                     f"{tok / mean(native, 'rollout_tokens_per_s'):.2f}x | {mean(label, 'turns'):.2f} | "
                     f"{mean(label, 'reward'):.3f} |")
    doc = ["# An agent through the OpenAI-compatible endpoint vs a native chat-form tools stage", "",
           f"`python benchmarks/bench_agent_endpoint.py --steps {args.steps} --repeats {args.repeats}` on "
           f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU, engine hf; each figure the mean of the repeats (each "
           "run's in brackets); one run at a time, alternating. Goal: the agent stage at 0.8x of native or better.", "",
           *lines, ""]
    RESULTS.write_text("\n".join(doc))
    print("\n".join(doc))


if __name__ == "__main__":
    main()
