"""The agent endpoint's own CPU per episode, with and without OpenAI's per-token logprobs object in each answer.

    python benchmarks/bench_agent_gateway.py [--episodes 64] [--rounds 6]

The shipped example agent (rlflow/stages/openai_calc_agent.py, the plain `openai` client) runs `--episodes` episodes at
once against the endpoint (runtime/agent_gateway.py LoopHub: FastAPI/uvicorn and the agents on one asyncio loop, as
in the AgentGateway actor). No engine: worker threads answer each request at once with a fixed turn of 70 token ids (a
calculator call, then `A=4`), the size the tiny model's turns have, so what is measured is the endpoint and the agents
(HTTP, the openai client's request building and response parsing, the calculator's sandboxed process is not counted:
it is another process). Two answer shapes, alternating round by round:
- `token_logprobs`: what rlflow sends unless the request asks for logprobs: the sampled ids' log-probs as one list;
- `logprobs object`: OpenAI's `choices[0].logprobs.content`, a {token, logprob, bytes, top_logprobs} object per token,
  which the client builds a model for each (what rlflow sent for every answer before).
Figures: CPU ms of this process per episode (the loop thread and the answering threads), median over rounds after
the first (imports and connection warm-up). Writes benchmarks/results/agent_gateway.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "agent_gateway.md"
TURN = 70  # token ids in a turn: a Hermes calculator call on the tiny model


def answer(eid: str, turn: int, logprob_objects: bool) -> dict:
    """A fixed chat answer: a calculator call first, then the final answer."""
    if turn == 0:
        message = {"role": "assistant", "content": "", "tool_calls": [{
            "id": f"call_{eid}", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": "2+2"})}}]}
    else:
        message = {"role": "assistant", "content": "A=4"}
    ids, lps = list(range(TURN)), [-0.1] * TURN
    choice = {"index": 0, "finish_reason": "tool_calls" if turn == 0 else "stop", "token_ids": ids,
              "token_logprobs": lps, "message": message, "logprobs": None}
    if logprob_objects:
        choice["logprobs"] = {"content": [{"token": "a", "logprob": lp, "bytes": None, "top_logprobs": []} for lp in lps]}
    return {"id": f"rlflow-{eid}-{turn}", "object": "chat.completion", "created": 0, "model": "rlflow-policy",
            "choices": [choice], "prompt_token_ids": list(range(200)),
            "usage": {"prompt_tokens": 200, "completion_tokens": TURN, "total_tokens": 200 + TURN},
            "rlflow": {"episode_id": eid, "versions": [0], "turn": turn}}


def main() -> None:
    from rlflow.runtime.agent_gateway import LoopHub

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    hub = LoopHub({"fn": "rlflow.stages.openai_calc_agent:calc_agent", "timeout_s": 60, "max_turns": 3})

    def episode(eid: str, objects: bool) -> None:
        event = hub.begin_and_wait(eid, {"prompt": "Ann has 2 pens and buys 2 more. How many pens now? Calc:"}, 20)
        turn = 0
        while event["kind"] in ("chat", "wait"):
            if event["kind"] == "wait":
                event = hub.next_event(eid, turn, 20)
                continue
            event = hub.reply_and_wait(eid, event["seq"], answer(eid, turn, objects), 20)
            turn += 1
        hub.end(eid)
        if event["kind"] != "done":
            raise RuntimeError(f"episode {eid} ended with {event}")

    shapes = {"token_logprobs (rlflow's default)": False, "logprobs object per token (OpenAI's, on request)": True}
    cpu: dict[str, list[float]] = {label: [] for label in shapes}
    with ThreadPoolExecutor(args.episodes) as pool:
        try:
            for r in range(args.rounds):
                for label, objects in shapes.items():
                    c0 = time.process_time()
                    ids = [f"r{r}-{objects:d}-{i}" for i in range(args.episodes)]
                    list(pool.map(episode, ids, [objects] * args.episodes))
                    if r:  # the first round imports and warms up
                        cpu[label].append((time.process_time() - c0) * 1000 / args.episodes)
                    print(f"round {r} {label}: {cpu[label][-1] if r else float('nan'):.1f} ms CPU an episode",
                          flush=True)
        finally:
            hub.close()
    base = statistics.median(cpu[next(iter(shapes))])
    lines = ["| answer shape | CPU ms an episode (median) | rounds | vs default |", "|---|---:|---|---:|"]
    for label, values in cpu.items():
        lines.append(f"| {label} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} | "
                     f"{statistics.median(values) / base:.2f}x |")
    text = "\n".join([
        "# The agent endpoint's CPU per episode, by answer shape", "",
        f"`python benchmarks/bench_agent_gateway.py --episodes {args.episodes} --rounds {args.rounds}` on "
        f"{platform.machine()}, {_cpus()} CPUs: the example agent (plain `openai` client), {args.episodes} episodes at "
        "once against the endpoint, each request answered at once with a fixed 70-token turn (no engine); CPU of the "
        f"endpoint's process per episode of two requests, the median of {args.rounds - 1} rounds after a warm-up one, "
        "the two shapes alternating.", "", *lines, ""])
    print("\n" + text)
    RESULTS.write_text(text)


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))

if __name__ == "__main__":
    main()
