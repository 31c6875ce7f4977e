"""The exactly-once ledger: every prompt group's state, durable under the run directory (SQLite, WAL).

A group moves drawn -> routed -> generated -> buffered -> trained, or ends filtered, dropped or aborted.
The driver records each transition as it happens and commits once per loop iteration, so a killed
driver loses at most the last iteration. The ledger answers what resume needs: which groups were trained
into the checkpoint the run resumes from, and which were drawn but not (they are generated again, first,
with their original prompts). It also checks the invariants of ARCHITECTURE.md §5 durably: a group is
trained at most once in the history that counts, and never above the staleness bound.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from rlflow.operators.policy import InvariantViolation

FILE = "ledger.sqlite"
TERMINAL = ("trained", "filtered", "dropped", "aborted")
SCHEMA = """
create table if not exists groups (
  gid text primary key, seq integer, task text, n integer, prompt text,
  state text, v_traj integer, step integer, staleness integer, attempt integer default 1);
create table if not exists trajectories (
  tid text primary key, gid text, state text, version integer, tokens integer, step integer);
create table if not exists meta (key text primary key, value text);
"""


class Ledger:
    def __init__(self, out_dir: Path, eta: int | None, *, fresh: bool):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / FILE
        if fresh:  # a new run in this directory starts a new record
            for suffix in ("", "-wal", "-shm"):
                Path(str(self.path) + suffix).unlink(missing_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("pragma journal_mode=wal")
        self.db.execute("pragma synchronous=normal")  # WAL: a commit survives a killed process
        self.db.executescript(SCHEMA)
        self.eta = eta
        self.pending: list[tuple[str, tuple]] = []
        self.seq = self.db.execute("select coalesce(max(seq), 0) from groups").fetchone()[0]

    # ------------------------------------------------------------------ transitions (buffered until flush)
    def _q(self, sql: str, args: tuple) -> None:
        self.pending.append((sql, args))

    def drawn(self, gid: str, prompt: dict) -> None:
        self.seq += 1
        self._q("insert into groups (gid, seq, task, n, prompt, state) values (?, ?, ?, ?, ?, 'drawn') "
                "on conflict(gid) do update set state='drawn', attempt=attempt+1, v_traj=null, step=null",
                (gid, self.seq, prompt["task"], prompt["n"], json.dumps(prompt)))

    def state(self, gid: str, state: str, v_traj: int | None = None) -> None:
        if v_traj is None:
            self._q("update groups set state=? where gid=?", (state, gid))
        else:
            self._q("update groups set state=?, v_traj=? where gid=?", (state, v_traj, gid))

    def finished(self, tid: str, gid: str, version: int, tokens: int) -> None:
        self._q("insert or replace into trajectories (tid, gid, state, version, tokens) values (?, ?, 'finished', ?, ?)",
                (tid, gid, version, tokens))

    def trajectories(self, tids, state: str, step: int | None = None) -> None:
        for tid in tids:
            self._q("update trajectories set state=?, step=? where tid=?", (state, step, tid))

    def trained(self, step: int, staleness: dict[str, int], tids) -> None:
        """A batch trained at `step`: each group exactly once, none above the bound."""
        for gid, s in staleness.items():
            if s < 0:
                raise InvariantViolation(f"ledger: group {gid} has negative staleness {s} (generated after step {step})")
            if self.eta is not None and s > self.eta:
                raise InvariantViolation(f"ledger: group {gid} trained with staleness {s} > eta {self.eta}")
            self._q("update groups set state='trained', step=?, staleness=? where gid=? and state != 'trained'",
                    (step, s, gid))
        self.trajectories(tids, "trained", step)
        self.flush()
        done = self.db.execute(f"select count(*) from groups where step=? and state='trained' and gid in "
                               f"({','.join('?' * len(staleness))})", (step, *staleness)).fetchone()[0]
        if done != len(staleness):
            raise InvariantViolation(f"ledger: {len(staleness) - done} group(s) of step {step} were already trained")

    def flush(self) -> None:
        """Commit what was recorded since the last flush, in one transaction."""
        if not self.pending:
            return
        with self.db:
            self.db.execute("begin")
            for sql, args in self.pending:
                self.db.execute(sql, args)
        self.pending = []

    # ------------------------------------------------------------------ resume
    def resume(self, step: int) -> tuple[list[dict], dict[str, int]]:
        """Roll the ledger back to a checkpoint at `step`: groups trained after it were lost with the weights.

        Returns (the prompts of every group drawn but not finished in the history that counts, in draw
        order — generated again first, under their own group ids — and the rows drawn per task).
        """
        self.flush()
        with self.db:
            self.db.execute("begin")
            self.db.execute("update groups set state='drawn', step=null, staleness=null where state='trained' and step > ?",
                            (step,))
            self.db.execute("delete from trajectories where gid in (select gid from groups where state not in "
                            f"({','.join('?' * len(TERMINAL))}))", TERMINAL)
        rows = self.db.execute(f"select prompt from groups where state not in ({','.join('?' * len(TERMINAL))}) "
                               "order by seq", TERMINAL).fetchall()
        drawn = dict(self.db.execute("select task, max(n) + 1 from groups group by task").fetchall())
        return [json.loads(p) for (p,) in rows], drawn

    def counts(self) -> dict[str, int]:
        """Groups per state (cumulative over the run and its resumes)."""
        self.flush()
        return dict(self.db.execute("select state, count(*) from groups group by state").fetchall())

    def check(self, steps: int, batch_groups: int) -> None:
        """Conservation from the ledger: `steps` steps trained batch_groups groups each, none twice."""
        self.flush()
        per_step = self.db.execute("select step, count(*) from groups where state='trained' group by step").fetchall()
        wrong = [(s, n) for s, n in per_step if n != batch_groups]
        if wrong or len(per_step) != steps:
            raise InvariantViolation(f"ledger: trained groups per step {dict(per_step)}; expected {steps} steps of "
                                     f"{batch_groups}")

    def close(self) -> None:
        self.flush()
        self.db.close()
