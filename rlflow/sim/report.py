"""Render a SimResult: a text table, and a PNG of the per-instance load timeline and staleness histogram."""

from __future__ import annotations

from pathlib import Path

from rlflow.sim.result import SimResult

_MAX_LINES = 16  # instances drawn individually in the timeline; beyond that, min / mean / max bands


def text_report(result: SimResult) -> str:
    """A two-column table of the run's headline numbers."""
    r = result
    rows = [
        ("policy / mode", f"{r.policy} / {r.mode}"),
        ("steps (warm-up)", f"{r.steps} ({r.warmup_steps})"),
        ("virtual time", f"{r.sim_time_s:,.1f} s (window {r.window_s:,.1f} s)"),
        ("trained tokens/s", f"{r.trained_tokens_per_s:,.1f}"),
        ("trained trajectories/s", f"{r.trained_trajectories_per_s:,.3f}"),
        ("generated tokens/s", f"{r.generated_tokens_per_s:,.1f}"),
        ("staleness mean / max", f"{r.mean_staleness:.3f} / {r.max_staleness}"),
        ("staleness histogram", "  ".join(f"{k}:{v}" for k, v in r.staleness_histogram.items())),
    ]
    if r.predicted is not None:
        p = r.predicted
        rows.append(
            ("predicted staleness", f"{p.mean:.3f} (PQS {p.pre_queue:.3f} + IQS {p.in_queue:.3f}, rho {p.rho:.2f});"
             f" error {r.mean_staleness - p.mean:+.3f}")
        )
    rows += [
        ("length trained / sampled", f"{r.mean_trained_length:,.1f} / {r.mean_sampled_length:,.1f}"
         f" (bias {r.length_bias:+.1%}; E[L] {r.expected_length:,.1f})"),
        ("idle trainer / rollout", f"{r.trainer_idle_ratio:.1%} / {r.rollout_idle_ratio:.1%}"),
    ]
    if len(r.stages) > 1:
        rows += [(f"stage {name}", _stage_line(s)) for name, s in r.stages.items()]
    if r.turns > 1:
        rows.append(("turns / env steps", f"{r.turns} / {r.env_steps:,}; {r.mean_env_waiting:,.1f} samples on an environment (mean)"))
    rows += [
        ("consumed / dropped / aborted", f"{r.consumed} / {r.dropped} / {r.aborted} groups"),
        ("preemptions / pulls", f"{r.preemptions} / {r.pulls}"),
        ("events / wall", f"{r.events:,} / {r.wall_s:.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _stage_line(s: dict) -> str:
    """One rollout stage's share of the training and of the rollout's idle time."""
    return (f"{s['instances']} instance(s); trained {s['trained_samples']:,} samples ({s['trained_share']:.1%}), "
            f"{s['trained_tokens']:,.0f} tokens, length {s['mean_trained_length']:,.1f} (max {s['max_trained_length']:,}, "
            f"E[L] {s['expected_length']:,.1f}); rollout idle {s['rollout_idle_ratio']:.1%}")


def plot_report(result: SimResult, path: str | Path) -> Path:
    """Write the load timeline (training steps shaded) and the staleness histogram to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_load, ax_hist) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [2.2, 1]})
    t = np.asarray(result.timeline_t)
    running = np.asarray(result.timeline_running)
    if running.shape[0] <= _MAX_LINES:
        for i, row in enumerate(running):
            ax_load.step(t, row, where="post", lw=0.9, label=f"instance {i}")
        if running.shape[0] > 1:
            ax_load.legend(fontsize=6, ncol=2, loc="upper right")
    else:
        ax_load.fill_between(t, running.min(axis=0), running.max(axis=0), step="post", alpha=0.3, label="min-max")
        ax_load.step(t, running.mean(axis=0), where="post", lw=1.2, label=f"mean of {running.shape[0]} instances")
        ax_load.legend(fontsize=7, loc="upper right")
    for start, end in result.train_steps:
        ax_load.axvspan(start, end, color="grey", alpha=0.08, lw=0)
    ax_load.set(xlabel="virtual time (s)", ylabel="running trajectories", title="per-instance load (training shaded)")
    hist = result.staleness_histogram
    ax_hist.bar(list(hist), list(hist.values()), color="tab:orange")
    ax_hist.set_xticks(list(hist))
    ax_hist.axvline(result.mean_staleness, color="k", ls="--", lw=1, label=f"mean {result.mean_staleness:.2f}")
    if result.predicted is not None:
        ax_hist.axvline(result.predicted.mean, color="tab:blue", ls=":", lw=1.5, label=f"predicted {result.predicted.mean:.2f}")
    ax_hist.legend(fontsize=7)
    ax_hist.set(xlabel="staleness (steps)", ylabel="groups", title=f"staleness ({result.policy})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(result: SimResult, out_dir: str | Path, stem: str = "sim") -> tuple[Path, Path]:
    """Write `<stem>.txt` (the table) and `<stem>.png` (the plots) under out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = out / f"{stem}.txt"
    text.write_text(text_report(result) + "\n")
    return text, plot_report(result, out / f"{stem}.png")
