"""A remote reward endpoint as a scorer (`http:` of a reward stage): one JSON POST per trajectory, at most
`concurrency` in flight from one reward actor, each with a timeout, retried with exponential backoff.

Request body: {"id": trajectory id, "prompt", "completion", "answer"}. Reply: a JSON number or {"reward": number}.
Retried: a connection error, a timeout, HTTP 429 and 5xx (the endpoint may recover). Not retried: any other 4xx and
a reply that is no number (asking again would get the same answer). When the retries run out the trajectory fails
with the last reason; it is never dropped and never scored twice (a retry replaces an attempt that gave no reward).
Standard library only (urllib).
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

#: the longest wait between two attempts, whatever backoff_s doubles to
MAX_BACKOFF_S = 30.0


class Attempt(Exception):
    """One attempt failed; `retry` says whether another may succeed, `timed_out` whether it ran out of time."""

    def __init__(self, why: str, *, retry: bool, timed_out: bool = False):
        super().__init__(why)
        self.retry, self.timed_out = retry, timed_out


def parse_reply(body: bytes) -> float:
    """A reply's reward: a JSON number or {"reward": number}, finite. Attempt (not retried) otherwise."""
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise Attempt(f"replied {body[:60]!r}, not JSON", retry=False) from None
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Attempt(f"replied {json.dumps(value)[:60]}, not a finite number (or {{\"reward\": number}})", retry=False)
    return float(value)


def backoff(attempt: int, backoff_s: float) -> float:
    """Seconds to wait before retry number `attempt` (1, 2, ...): backoff_s, doubled each time, at most MAX_BACKOFF_S."""
    return min(backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)


class HttpReward:
    """Rewards from `url`; `score(items)` -> (reward, "", False) or (nan, why, timed_out) per item."""

    def __init__(self, url: str, *, timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.5,
                 concurrency: int = 8, headers: dict | None = None, sleep=time.sleep):
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.sleep = sleep
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="reward-http")
        self.attempts = 0  # requests sent, retries included

    def score(self, items: list[dict]) -> list[tuple[float, str, bool]]:
        return list(self.pool.map(self.score_one, items))

    def score_one(self, item: dict) -> tuple[float, str, bool]:
        body = json.dumps({"id": item.get("traj_id"), "prompt": item["prompt"], "completion": item["completion"],
                           "answer": item.get("answer")}).encode()
        for attempt in range(self.retries + 1):
            if attempt:
                self.sleep(backoff(attempt, self.backoff_s))
            try:
                return self._post(body), "", False
            except Attempt as failed:
                last = failed
                if not failed.retry:
                    break
        tries = f"{attempt + 1} attempt{'s' * (attempt > 0)}"
        return math.nan, f"{self.url} {last} ({tries})", last.timed_out

    def _post(self, body: bytes) -> float:
        self.attempts += 1
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return parse_reply(reply.read())
        except urllib.error.HTTPError as e:
            retry = e.code == 429 or e.code >= 500
            raise Attempt(f"answered HTTP {e.code}", retry=retry) from None
        except TimeoutError:
            raise Attempt(f"timed out after {self.timeout_s:g} s", retry=True, timed_out=True) from None
        except urllib.error.URLError as e:
            timed_out = isinstance(e.reason, TimeoutError)
            why = f"timed out after {self.timeout_s:g} s" if timed_out else f"could not be reached ({e.reason})"
            raise Attempt(why, retry=True, timed_out=timed_out) from None
        except (ConnectionError, OSError) as e:  # reset mid-reply, and the like
            raise Attempt(f"failed: {type(e).__name__}: {e}", retry=True) from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
