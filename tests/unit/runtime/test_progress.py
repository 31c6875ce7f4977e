"""The progress output: ETA from recent step times, one line redrawn in place on a terminal (never wider than it),
one plain line per step in a log; the step's fields and the end-of-run summary."""

import io
import re

import pytest

from rlflow.runtime.progress import BAR_WIDTH, Field, Progress, fit, format_duration

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
FIELDS = [Field("step 12/100"), Field("reward(all) 0.412"), Field("reward(trained) 0.620"), Field("loss +0.0803", 1),
          Field("elapsed 1 m 05 s", 2), Field("staleness 0.44 (max 1)", 3), Field("112.6 traj/s", 4)]


def test_eta_uses_recent_step_times_not_startup():
    p = Progress(10, stream=io.StringIO(), tty=False, window=3)
    assert p.eta_s(1, now=40.0) is None  # the first step's time includes the start-up: no estimate yet
    assert p.eta_s(2, now=42.0) == 8 * 2.0
    assert p.eta_s(3, now=46.0) == 7 * 3.0  # mean of 2 s and 4 s
    p.eta_s(4, now=47.0)
    assert p.eta_s(5, now=48.0) == 5 * (4.0 + 1.0 + 1.0) / 3  # window of the last 3 steps
    assert p.eta_s(10, now=49.0) == 0.0


def test_log_gets_one_line_per_step_with_eta_and_no_escape_codes():
    out = io.StringIO()
    p = Progress(4, stream=out, tty=False)
    for i, t in enumerate([10.0, 11.0, 12.0, 13.0], start=1):
        p.step(i, [Field(f"step {i}/4"), Field("loss +0.1", 1)], now=t)
    lines = out.getvalue().splitlines()
    assert lines == ["step 1/4  loss +0.1", "step 2/4  ETA 2 s  loss +0.1", "step 3/4  ETA 1 s  loss +0.1",
                     "step 4/4  loss +0.1"]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


@pytest.mark.parametrize("width", [200, 120, 80, 60, 40, 20])
def test_fit_keeps_the_most_important_fields_within_the_width(width):
    line = fit(FIELDS, width)
    assert len(line) <= width
    assert line.startswith("step 12/100"[:width - 1])
    if width >= 200:
        assert line == "  ".join(f.text for f in FIELDS)


def test_fit_drops_the_least_important_first_and_keeps_the_order():
    assert fit(FIELDS, 80 - BAR_WIDTH - 1) == "step 12/100  reward(all) 0.412  reward(trained) 0.620  loss +0.0803"
    assert fit(FIELDS, 100) == ("step 12/100  reward(all) 0.412  reward(trained) 0.620  loss +0.0803  elapsed 1 m 05 s")
    assert fit(FIELDS, 30) == "step 12/100  reward(all) 0.41…"  # the rank-0 fields, cut with an ellipsis


def test_terminal_line_is_redrawn_in_place_within_80_columns_and_messages_go_above_it():
    out = io.StringIO()
    p = Progress(20, stream=out, tty=True, width=80)  # keeps a line above every 2 steps
    p.message("before the first step")
    p.step(1, FIELDS, now=0.0)
    p.message("eval of step 1: accuracy 0.5")
    p.step(2, FIELDS, now=1.0)
    for i in range(3, 21):
        p.step(i, FIELDS, now=float(i))
    assert p.live is None  # the last step ends the display
    text = ANSI.sub("", out.getvalue())
    assert text.startswith("before the first step\n")
    rows = [part for line in text.split("\n") for part in line.split("\r")]
    assert max(len(r) for r in rows) <= 80
    assert "eval of step 1: accuracy 0.5" in rows
    drawn = [r for r in rows if "step 12/100" in r and ("━" in r or "╸" in r)]
    assert len(drawn) >= 20 and all("reward(all) 0.412" in r for r in drawn)
    assert out.getvalue().count("\r") >= 20  # each step redrawn over the last, not printed below it
    kept = [r for r in rows if r.startswith("step 12/100")]
    assert len(kept) == 9  # steps 2, 4, ... 18 kept above; the last step stays as the drawn line


def test_terminal_line_ends_when_closed_early():
    out = io.StringIO()
    p = Progress(10, stream=out, tty=True, width=60)
    p.step(1, FIELDS, now=0.0)
    p.close()
    p.message("stopping on Ctrl-C")
    text = ANSI.sub("", out.getvalue())
    assert p.live is None and text.endswith("reward(all) 0.412  reward(trained) …\nstopping on Ctrl-C\n")
    assert text.count("step 12/100") == 2  # a short run keeps no history above the line: drawn, and drawn at the end


def test_format_duration():
    assert [format_duration(s) for s in (0.4, 59, 61, 3725)] == ["0 s", "59 s", "1 m 01 s", "1 h 02 m"]
