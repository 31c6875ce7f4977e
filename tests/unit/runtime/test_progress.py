"""The progress output: ETA from recent step times, a bar redrawn in place on a terminal, one line per step in a log."""

import io

from rlflow.runtime.progress import Progress, format_duration


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
        p.step(i, f"step {i}/4", now=t)
    lines = out.getvalue().splitlines()
    assert lines == ["step 1/4", "step 2/4  ETA 2 s", "step 3/4  ETA 1 s", "step 4/4"]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_terminal_bar_redraws_in_place_and_messages_end_it_first():
    out = io.StringIO()
    p = Progress(20, stream=out, tty=True)  # keeps a permanent line every 2 steps
    p.step(1, "step 1/20", now=0.0)
    assert out.getvalue().startswith("\r\x1b[K[#...................] step 1/20") and not out.getvalue().endswith("\n")
    p.message("eval of step 1: accuracy 0.5")
    assert out.getvalue().endswith("step 1/20\neval of step 1: accuracy 0.5\n")  # not glued onto the bar
    p.step(2, "step 2/20", now=1.0)
    assert out.getvalue().endswith("[##..................] step 2/20  ETA 18 s\n")
    p.message("done")
    assert not out.getvalue().endswith("\n\ndone\n")  # no blank line when the bar already ended


def test_format_duration():
    assert [format_duration(s) for s in (0.4, 59, 61, 3725)] == ["0 s", "59 s", "1 m 01 s", "1 h 02 m"]
