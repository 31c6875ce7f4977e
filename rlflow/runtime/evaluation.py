"""Evaluation: held-out prompts scored at a given weights version, on an engine of its own.

The held-out split is a hash of the prompt text (`held_out`): the same rows every run and every process, and
prompt_source.py skips them, so they are never trained on. A data.eval file is held out by being a file of
its own. Each evaluation drives the engine in-process: one greedy completion per prompt (temperature 0, the
argmax token; engine.py documents its log-probs) and k samples at the rollout temperature, each scored by the
task's reward function. The `Evaluator` actor does that inside `rlflow run` at the versions the driver sends
it (training goes on meanwhile: the driver gets the result as an event); `rlflow eval` does it in-process.

Metrics (MLflow, at the step whose weights were evaluated): eval/accuracy (greedy completions with reward
>= 1), eval/pass_at_<k> (pass@k: MLflow names allow no "@"; the unbiased estimator of Chen et al. 2021),
eval/reward_mean (greedy), eval/sample_reward_mean, eval/accuracy_len_<short|medium|long> (by the reference answer's token length, terciles of the held-out set);
with several tasks also eval/<task>/... per task.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import ray

from rlflow.data_sources import generated
from rlflow.plan_model import EvaluatorActor, Plan
from rlflow.prompt_rows import (
    BUILTIN_TASK_ROWS,
    encode_prompt,
    held_out,
    plain,
    prompt_text,
    row_problem_as,
    row_prompt_answer,
)
from rlflow.runtime.messages import EvalPrompt, EvalTask, Evaluated, Started

EVAL_INSTANCE = 1_000  # the evaluator engine's instance id (seeds its sampler apart from the rollout instances)
BUCKETS = ("short", "medium", "long")


# ---------------------------------------------------------------------------------------------- pure parts
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021, eq. 1,
    in its numerically stable product form). With n == k it is 1 if any sample is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def bucket_edges(lengths: list[int]) -> tuple[int, int]:
    """Tercile edges of answer lengths: short <= e1 < medium <= e2 < long (a bucket may be empty when lengths tie)."""
    s = sorted(lengths)
    if not s:
        return (0, 0)
    return s[math.ceil(len(s) / 3) - 1], s[math.ceil(2 * len(s) / 3) - 1]


def bucket(length: int, edges: tuple[int, int]) -> str:
    return BUCKETS[0] if length <= edges[0] else BUCKETS[1] if length <= edges[1] else BUCKETS[2]


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def summarize(results: list[dict], k: int, prefix: str = "eval/") -> dict:
    """Metrics of per-prompt results {greedy_reward, sample_rewards, bucket}."""
    correct = [r["greedy_reward"] >= 1.0 for r in results]
    out = {f"{prefix}accuracy": _mean(correct), f"{prefix}pass_at_{k}": _mean(
        [pass_at_k(len(r["sample_rewards"]), sum(x >= 1.0 for x in r["sample_rewards"]), k) for r in results]),
        f"{prefix}reward_mean": _mean([r["greedy_reward"] for r in results]),
        f"{prefix}sample_reward_mean": _mean([x for r in results for x in r["sample_rewards"]]),
        f"{prefix}prompts": len(results)}
    for b in BUCKETS:
        mine = [c for c, r in zip(correct, results) if r["bucket"] == b]
        if mine:
            out[f"{prefix}accuracy_len_{b}"] = _mean(mine)
    return out


# ---------------------------------------------------------------------------------------------- held-out rows
def read_file(path: str, loc: tuple[str, ...] = ("data", "eval"), prefix: str = "held-out row: ",
              split: str | None = None):
    """(where, row) for the rows of a .jsonl / .json / .parquet file, a `datasets` directory (its `split`) or an
    .arrow file, in file order ("'p.jsonl' line 7"); a line that is not a JSON object is invalid input naming its
    line (data_head.py words it as the head check does), at pipeline location `loc`."""
    from rlflow.data_head import READ_FIX, _json_lines
    from rlflow.data_sources import TableProblem, generated, is_table, read_table

    if generated(path):  # a taskset through an adapter (verifiers:...): its rows in order
        from rlflow import registry

        yield from ((f"row {i + 1} of {path}", row) for i, row in enumerate(registry.resolve("task", path)(seed=0)))
        return
    if is_table(path):
        try:
            table = read_table(path, split)
        except TableProblem as err:
            bad_row(err.problem, path, loc, prefix)
        for batch in table.to_batches(max_chunksize=1024):
            yield from ((f"'{path}' row {n + 1}", row) for n, row in enumerate(batch.to_pylist()))
        return
    if Path(path).suffix == ".parquet":
        import pyarrow.parquet as pq

        n = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                n += 1
                yield f"'{path}' row {n}", row
        return
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        yield from ((f"'{path}' item {i + 1}", row) for i, row in enumerate(json.loads(text)))
        return
    for number, row in _json_lines(path):
        if not isinstance(row, dict):
            bad_row((f"cannot read '{path}' line {number}: not a JSON object ({row})", "bad-data", READ_FIX), path,
                    loc, prefix)
        yield f"'{path}' line {number}", row


def bad_row(problem: tuple[str, str, str], source: str, loc: tuple[str, ...] = ("data", "eval"),
            prefix: str = "held-out row: "):
    from rlflow.errors import PipelineInvalid, Problem

    raise PipelineInvalid(source, [Problem(loc, prefix + problem[0], *problem[1:])])


def held_out_rows(task: dict, *, size: int, seed: int) -> list[dict]:
    """The first `size` held-out rows, in source order, as {"prompt", "answer", "row"}.

    task: {"source", "holdout" (fraction or None: every row of `source` is held out, a data.eval file), "limit",
    "prompt_field", "answer_field"}. A built-in task is generated as prompt_source.py generates it (same seed),
    so a fraction names the very rows training skips; without a `limit` the generator runs on past the
    training rows until `size` held-out rows are found (their prompts hash as held out, so none is trained on).
    A prompt that recurs is kept each time: the held-out set has the task's own mix (deduplicating would
    over-weight rare prompts; on `repeat` those are the long answers, which cut greedy accuracy from 36% to
    15% at the warm start)."""
    from rlflow import registry

    src, frac = task["source"], task.get("holdout")
    pf, af = task.get("prompt_field", "prompt"), task.get("answer_field", "answer")
    fmt = task.get("prompt_format") or "raw"
    if generated(src):
        count = task.get("limit") or max(BUILTIN_TASK_ROWS, math.ceil(2 * size / (frac or 1)))
        rows = ((f"row {i + 1} of {src}", r) for i, r in enumerate(registry.resolve("task", src)(seed=seed, count=count)))
    else:
        rows = read_file(src, split=task.get("split"))
    out = []
    for n, (where, row) in enumerate(rows):
        if task.get("limit") and n >= task["limit"]:
            break
        if problem := row_problem_as(row, (pf, af), where, fmt):  # as training's reader judges it: stop, naming the row
            bad_row(problem, src)
        if frac is not None and not held_out(str(row[pf]), frac):
            continue
        prompt, answer = row_prompt_answer(row, (pf, af), fmt)
        out.append({"prompt": prompt, "answer": answer, "row": plain(row)})
        if len(out) >= size:
            break
    return out


def encode(tokenizer, rows: list[dict], prompt_format: str = "raw", system_prompt: str | None = None) -> list[EvalPrompt]:
    """Held-out rows as EvalPrompts: their prompt ids (exactly as prompt_source.py formats training prompts) and
    the answer's token length (buckets)."""
    return [EvalPrompt(prompt_text(r["prompt"]), r["answer"], r.get("row", {}),
                       encode_prompt(tokenizer, r["prompt"], prompt_format, system_prompt),
                       len(tokenizer(r["answer"], add_special_tokens=False)["input_ids"])) for r in rows]


# ---------------------------------------------------------------------------------------------- scoring
@contextlib.contextmanager
def _sampling(engine, temperature: float, max_new_tokens: int):
    """Generate with these settings (engines read them per request / per decode step), then restore them."""
    saved = engine.temperature, engine.max_new_tokens
    engine.temperature, engine.max_new_tokens = temperature, max_new_tokens
    try:
        yield
    finally:
        engine.temperature, engine.max_new_tokens = saved


def generate(engine, rows: list[EvalPrompt], samples: int, *, temperature: float, max_new_tokens: int, tag: str,
             episodes=None) -> dict:
    """Completions {(row index, sample index): text}, generated to the end on an idle engine; with `episodes`
    (runtime/episodes.py), whole multi-turn episodes, their environments called between turns."""
    from rlflow.stages.trajectory import Trajectory

    done = {}

    def finish(t) -> None:
        done[(int(t.group_id.rsplit("-", 1)[1]), t.index)] = t.completion

    with _sampling(engine, temperature, max_new_tokens):
        for i, r in enumerate(rows):
            for j in range(samples):
                traj = Trajectory(group_id=f"{tag}-{i}", index=j, prompt=r.prompt, answer=r.answer,
                                  prompt_ids=list(r.prompt_ids), row=r.row)
                if episodes:
                    episodes.begin(traj)
                engine.start(traj)
        while not engine.idle or (episodes and episodes.waiting):
            turns = engine.step() if not engine.idle else []
            for t in episodes.finished(turns) if episodes else turns:
                finish(t)
            for t in episodes.returned(engine, wait_s=0.0 if not engine.idle else 0.5) if episodes else []:
                finish(t)
    return done


def score_task(engine, rows: list[EvalPrompt], reward_fn, *, k: int, temperature: float, max_new_tokens: int,
               edges: tuple[int, int] | None = None, episodes=None) -> tuple[list[dict], int]:
    """Per-prompt results {greedy_reward, sample_rewards, bucket, greedy} and the number of reward calls that
    failed (scored 0)."""
    from rlflow.runtime.reward_call import as_reward, reward_caller

    call, failed = reward_caller(reward_fn), 0

    def reward(text: str, r: EvalPrompt) -> float:
        nonlocal failed
        try:
            return as_reward(call(text, r.answer, r.prompt, r.row))
        except Exception:  # noqa: BLE001 - a failing reward scores 0 here; training counts its failures itself
            failed += 1
            return 0.0

    greedy = generate(engine, rows, 1, temperature=0.0, max_new_tokens=max_new_tokens, tag="greedy", episodes=episodes)
    sampled = generate(engine, rows, k, temperature=temperature, max_new_tokens=max_new_tokens, tag="sample",
                       episodes=episodes)
    edges = edges or bucket_edges([r.answer_tokens for r in rows])
    results = [{"greedy": greedy[(i, 0)], "greedy_reward": reward(greedy[(i, 0)], r),
                "sample_rewards": [reward(sampled[(i, j)], r) for j in range(k)],
                "bucket": bucket(r.answer_tokens, edges)} for i, r in enumerate(rows)]
    return results, failed


def evaluate(engine, tasks: dict[str, EvalTask], k: int, episodes=None) -> dict:
    """Metrics over every task's held-out rows (each task's reward_fn resolved to a callable); several tasks add
    eval/<task>/... beside the overall metrics."""
    t0 = time.perf_counter()
    metrics, everything, failed = {}, [], 0
    for name, t in tasks.items():
        results, bad = score_task(engine, t.rows, t.reward_fn, k=k, temperature=t.temperature,
                                  max_new_tokens=t.max_new_tokens, episodes=episodes)
        everything += results
        failed += bad
        if len(tasks) > 1:
            metrics.update(summarize(results, k, prefix=f"eval/{name}/"))
    metrics.update(summarize(everything, k))
    metrics["eval/reward_failed"] = failed
    metrics["eval/seconds"] = time.perf_counter() - t0
    return metrics


# ---------------------------------------------------------------------------------------------- in a run
def prepare(actor: EvaluatorActor, tokenizer, source: str) -> dict[str, EvalTask]:
    """The plan's evaluator tasks with their held-out rows read and tokenized (in the driver, where data files are)."""
    out = {}
    for name, t in actor.tasks.items():
        rows = encode(tokenizer, held_out_rows(t, size=actor.size, seed=actor.seed), t.get("prompt_format", "raw"),
                      t.get("system_prompt"))
        if not rows:
            from rlflow.errors import PipelineInvalid, Problem

            raise PipelineInvalid(source, [Problem(("data", "eval"), f"task '{name}' has no held-out rows in "
                                                        f"'{t['source']}'", "empty-eval",
                                                        "raise the fraction, or give a file with prompts and answers")])
        out[name] = EvalTask(rows, t["reward_fn"], t["temperature"], t["max_new_tokens"])
    return out


@ray.remote
class Evaluator:
    """An engine of its own, with the first rollout stage's settings: scores the held-out rows at a weights version.
    It is not a rollout instance: the coordinator never routes to it, nothing it generates reaches the trajectory
    store, the ledger or the staleness accounting. Calls queue in the actor, one at a time, in order."""

    def __init__(self, engine: str, model_dir, engine_kwargs: dict, tasks: dict[str, EvalTask], k: int,
                 episode: dict | None = None):
        from rlflow import registry
        from rlflow.runtime.actor_threads import one_thread
        from rlflow.runtime.episodes import episodes_for
        from rlflow.runtime.model_shipping import local_model_dir

        one_thread()
        model_dir = local_model_dir(model_dir)
        self.engine = registry.resolve("engine", engine)(model_dir, instance_id=EVAL_INSTANCE, **engine_kwargs)
        self.episodes = episodes_for(episode, model_dir, engine_kwargs)  # multi-turn: episodes, as in training
        self.tasks = {n: replace(t, reward_fn=registry.resolve("reward", t.reward_fn)) for n, t in tasks.items()}
        self.k = k

    def ready(self) -> bool:
        return True

    def evaluate(self, version: int, published) -> dict:
        """Metrics of weights `version` (a parameter_server.Published); the weights are loaded first, and checked."""
        from rlflow.runtime.parameter_server import pull_into

        loaded = pull_into(self.engine, published, version)
        if loaded.checksum != published.checksum:
            raise RuntimeError(f"the evaluator loaded version {version} with checksum {loaded.checksum}, "
                               f"published {published.checksum}")
        return {"version": version, **evaluate(self.engine, self.tasks, self.k, self.episodes)}

    def close(self) -> None:
        if hasattr(self.engine, "close"):
            self.engine.close()


class Evaluations:
    """The driver's side: which steps are evaluated, the calls in flight, and their results.

    Evaluated: the initial weights and every `every` steps (every > 0), and the last step of a run that finishes.
    A call is started and the driver goes on; the result comes back as an Evaluated event (messages.py)."""

    def __init__(self, plan: dict | Plan, model_dir: str, tokenizer):
        from rlflow.runtime.model_shipping import ship_model

        plan = Plan.of(plan)
        spec = plan.evaluator
        self.enabled = spec is not None
        self.every = spec.every if spec else 0
        self.pending: dict[int, object] = {}  # step -> ObjectRef of its result
        self.done: set[int] = set()
        self.actor = None
        if spec:
            self.actor = Evaluator.options(num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, resources=spec.resources).remote(
                spec.engine, ship_model(model_dir), spec.engine_kwargs, prepare(spec, tokenizer, plan.source), spec.k,
                spec.episode)

    def ready_refs(self) -> list:
        return [self.actor.ready.remote()] if self.actor else []

    def due(self, step: int, *, final: bool = False) -> bool:
        if not self.enabled or step in self.pending or step in self.done:
            return False
        return final or (self.every > 0 and step % self.every == 0)

    def submit(self, step: int, published) -> Started:
        """Evaluate the weights `published` (parameter_server.Published) as those of `step`; returns the call, for
        the driver to wait on (or `wait` takes its result at the end of the run)."""
        ref = self.actor.evaluate.remote(published.version, published)
        self.pending[step] = ref
        return Started(ref, Evaluated(step))

    def result(self, step: int, future) -> dict | None:
        """The metrics of a finished evaluation (None if it was already taken), raising RunFailed if it failed."""
        from rlflow.errors import RunFailed

        if self.pending.pop(step, None) is None:
            return None
        self.done.add(step)
        try:
            return future.result()
        except ray.exceptions.RayError as err:
            raise RunFailed(f"the evaluator failed on the weights of step {step}: {err}") from None

    def wait(self, timeout_s: float) -> dict[int, dict]:
        """Every evaluation still in flight, in step order (the end of a run)."""
        from rlflow.errors import RunFailed

        out = {}
        for step in sorted(self.pending):
            ref = self.pending.pop(step)
            self.done.add(step)
            try:
                out[step] = ray.get(ref, timeout=timeout_s)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
                raise RunFailed(f"the evaluator failed on the weights of step {step}: {type(err).__name__}: {err}") from None
        return out


# ---------------------------------------------------------------------------------------------- `rlflow eval`
def _bad(message: str, fix: str, loc: str = "--data", rule: str = "bad-eval-input"):
    from rlflow.errors import PipelineInvalid, Problem

    raise PipelineInvalid("rlflow eval", [Problem((loc,), message, rule, fix)])


SOURCES = "builtin:<task>, a .jsonl/.json/.parquet/.arrow file, a `datasets` directory or verifiers:pkg.mod:load_taskset"


def _check_source(data: str, split: str | None) -> None:
    """An --data source is refused, naming the rule, as compile refuses a data.source: an unknown built-in, a
    taskset that does not load, a missing file, a directory that is not a `datasets` one or a split it lacks."""
    from rlflow import registry
    from rlflow.component_checks import component
    from rlflow.data_sources import TableProblem, is_table, read_table
    from rlflow.errors import PipelineInvalid, Problem

    if generated(data):
        if split is not None:
            _bad(f"'{data}' has no splits (--split {split})", "--split picks a split of a DatasetDict directory",
                 loc="--split")
        if data.startswith("builtin:") and data not in registry.builtin_names("task"):
            _bad(f"unknown built-in task '{data}'", "built-in tasks: " + ", ".join(registry.builtin_names("task")))
        problems: list[Problem] = []
        component(problems, "task", data, ("--data",))  # as compile checks a data.source
        if problems:
            raise PipelineInvalid("rlflow eval", problems)
    elif is_table(data):
        try:
            read_table(data, split)
        except TableProblem as err:
            message, rule, fix = err.problem
            raise PipelineInvalid("rlflow eval", [Problem(("--split" if rule == "bad-split" else "--data",), message,
                                                          rule, fix.replace("set split: to", "give --split"))]) from None
    elif not (data.endswith((".jsonl", ".json", ".parquet")) and Path(data).is_file()):
        _bad(f"'{data}' is none of {SOURCES}", "built-in tasks: " + ", ".join(registry.builtin_names("task")))
    elif split is not None:
        _bad(f"'{data}' is one file, which has no splits (--split {split})",
             "--split picks a split of a DatasetDict directory", loc="--split")


def eval_tasks(plan: dict | Plan | None, *, data: str | None, task: str | None, reward: str | None, n: int | None,
               k: int | None, max_new_tokens: int | None, temperature: float | None,
               split: str | None = None) -> tuple[dict, dict]:
    """What `rlflow eval` scores: per task {source, split, holdout, limit, prompt_field, answer_field, reward_fn,
    max_new_tokens, temperature}, and the settings {size, k, seed, top_p, max_running, max_model_len}. Defaults come
    from the plan an export carries (its held-out split, rewards and rollout settings), else plain ones. `data` is
    any data.source: builtin:<task>, a .jsonl/.json/.parquet/.arrow file, a `datasets` directory (`split` picks a
    DatasetDict's split; the run's own when `data` is its source) or a `verifiers:` taskset."""
    from rlflow import registry

    plan = Plan.of(plan) if plan is not None else None
    evaluator = plan.evaluator if plan else None
    rollouts = plan.rollouts() if plan else []
    first = rollouts[0].engine_kwargs if rollouts else {}
    settings = {"size": n or (evaluator.size if evaluator else 128), "k": k or (evaluator.k if evaluator else 4),
                "seed": plan.pipeline["data"]["seed"] if plan else 0,
                "top_p": first.get("top_p", 1.0), "max_running": first.get("max_running", 64),
                "max_model_len": plan.model["max_model_len"] if plan else None,
                # completions end, and episodes call their environment, as in the run
                "stop": first.get("stop", []), "max_turn_tokens": first.get("max_turn_tokens"),
                "episode": rollouts[0].episode if rollouts else None}
    ptasks = plan.tasks if plan else {}
    if task is not None and plan is not None and task not in ptasks:
        _bad(f"the run has no task '{task}' (tasks: {', '.join(ptasks)})", "name one of them", loc="--task")
    if data is None:
        if evaluator is None:
            _bad("no --data, and the model carries no run's held-out split (data.eval)",
                 f"give --data {SOURCES} of prompts and answers")
        if split is not None:
            _bad("--split without --data", "--split picks a split of the DatasetDict directory --data names", loc="--split")
        chosen = {name: dict(t) for name, t in evaluator.tasks.items() if task in (None, name)}
    else:
        if task is None and len(ptasks) > 1:
            _bad(f"the run has several tasks ({', '.join(ptasks)}): which one's reward scores --data?", "add --task NAME",
                 loc="--task")
        name = task or next(iter(ptasks), "main")
        pt = ptasks.get(name)
        # the run's own source: keep its held-out split (and its DatasetDict split)
        same = pt is not None and (pt.source == data or Path(pt.source).resolve() == Path(data).resolve())
        split = split if split is not None or not same else pt.split
        _check_source(data, split)
        rollout = next((a for a in rollouts if name in a.tasks), None)
        op = next((op for op in plan.reward_operators() if pt and op.stage == pt.reward), None) if plan else None
        fn = op.fn if op else "exact_match"
        if fn is None and reward is None:  # a reward model / judge / endpoint only: eval runs none of them
            kinds = sorted({k for part in op.scorers for k in ("model", "judge", "http") if part.get(k)})
            _bad(f"reward stage '{op.stage}' scores task '{name}' with {' and '.join(kinds)} only, and rlflow eval "
                 "scores with a reward function", f"give --reward NAME (built-in or package.module:fn), or add eval_fn: "
                 f"<a reward function> to stage '{op.stage}'", loc="--reward", rule="eval-needs-reward-fn")
        chosen = {name: {"source": data, **({"split": split} if split else {}),
                         "holdout": pt.holdout if same else None, "limit": pt.limit if same else None,
                         "prompt_field": pt.prompt_field if pt else "prompt",
                         "answer_field": pt.answer_field if pt else "answer", "reward_fn": fn,
                         "prompt_format": pt.prompt_format if pt else "raw", "system_prompt": pt.system_prompt if pt else None,
                         "max_new_tokens": rollout.engine_kwargs["max_new_tokens"] if rollout else 64,
                         "temperature": rollout.engine_kwargs["temperature"] if rollout else 1.0}}
    for t in chosen.values():
        t.update({k: v for k, v in (("reward_fn", reward), ("max_new_tokens", max_new_tokens), ("temperature", temperature))
                  if v is not None})
        try:
            registry.resolve("reward", t["reward_fn"])
        except Exception as err:  # noqa: BLE001 - a bad reference is the user's input
            _bad(f"reward '{t['reward_fn']}': {err}", "built-in rewards: " + ", ".join(registry.builtin_names("reward")),
                 loc="--reward")
    return chosen, settings


def run_eval(model_dir: str, tasks: dict[str, dict], settings: dict, *, engine: str = "hf") -> dict:
    """Score `model_dir` in this process (no Ray): the rows of each task read, tokenized, generated and rewarded."""
    from transformers import AutoConfig, AutoTokenizer

    from rlflow import registry

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prepared = {}
    for name, t in tasks.items():
        rows = encode(tokenizer, held_out_rows(t, size=settings["size"], seed=settings["seed"]),
                      t.get("prompt_format", "raw"), t.get("system_prompt"))
        if not rows:
            _bad(f"task '{name}': no rows to score in '{t['source']}'", "check --data and its prompt/answer fields")
        prepared[name] = EvalTask(rows, registry.resolve("reward", t["reward_fn"]), t["temperature"], t["max_new_tokens"])
    max_new = max(t.max_new_tokens for t in prepared.values())
    longest = max(len(r.prompt_ids) for t in prepared.values() for r in t.rows)
    limit = getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None) or 4096
    max_model_len = settings["max_model_len"] or min(limit, max(512, longest + max_new + 1))
    if longest + max_new > max_model_len:
        _bad(f"a prompt of {longest} tokens + max_new_tokens {max_new} exceeds the model length {max_model_len}",
             "lower --max-new-tokens, or score shorter prompts")
    first = next(iter(prepared.values()))
    eng = registry.resolve("engine", engine)(model_dir, max_running=settings["max_running"], max_new_tokens=max_new,
                                             temperature=first.temperature, top_p=settings["top_p"],
                                             seed=settings["seed"], max_model_len=max_model_len,
                                             stop=settings.get("stop", ()), max_turn_tokens=settings.get("max_turn_tokens"))
    from rlflow.runtime.episodes import episodes_for

    episodes = episodes_for(settings.get("episode"), model_dir, {"max_new_tokens": max_new, "stop": settings.get("stop", ())})
    try:
        return evaluate(eng, prepared, settings["k"], episodes)
    finally:
        if hasattr(eng, "close"):
            eng.close()
