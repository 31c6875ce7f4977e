"""Recall of the longest 20% for StreamRL's length ranker (StreamRL §5.2, §7.2), on real completions.

    python benchmarks/bench_ranker.py [--task repeat] [--batches 8] [--batch-size 256]

The tiny model (builtin:tiny-llama warm-started on --task) samples one completion per prompt with the
hf engine, a batch at a time, as a rollout stage would. Before each batch is generated, the online ranker
(OnlineLengthRanker: ridge regression on hashed prompt n-grams, refit from every completed length so
far) predicts its lengths; recall@20% is the share of the batch's truly longest 20% that the ranker
also puts in its top 20%. A random ranker's expected recall is 0.2. The first batch has nothing to
learn from (all predictions equal). Prints a table and writes benchmarks/results/ranker.md.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from results_table import publish_table

RESULTS = Path(__file__).parent / "results" / "ranker.md"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="repeat", choices=("repeat", "arith"))
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from rlflow.operators.length_ranker import OnlineLengthRanker, recall_at_top
    from rlflow.stages import tasks
    from rlflow.stages.engine_hf import HFEngine
    from rlflow.stages.tiny_model import build_tiny_llama
    from rlflow.stages.trajectory import Trajectory

    model_dir = build_tiny_llama(args.task, progress=lambda line: print(line, flush=True))
    engine = HFEngine(model_dir, max_running=args.batch_size, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
    rows = getattr(tasks, args.task)(1, args.batches * args.batch_size)
    ranker, rng = OnlineLengthRanker(), random.Random(0)
    table = []
    for b in range(args.batches):
        batch = rows[b * args.batch_size:(b + 1) * args.batch_size]
        prompts = [r["prompt"] for r in batch]
        predicted = ranker.predict(prompts)
        trajs = [Trajectory(group_id=f"b{b}-{i}", index=0, prompt=p, answer="", prompt_ids=engine.tokenizer(p)["input_ids"])
                 for i, p in enumerate(prompts)]
        for t in trajs:
            engine.start(t)
        while not engine.idle:
            engine.step()
        lengths = [len(t.completion_ids) for t in trajs]
        baseline = recall_at_top([rng.random() for _ in lengths], lengths)
        table.append((b + 1, sum(lengths) / len(lengths), max(lengths), recall_at_top(predicted, lengths), baseline))
        print(f"batch {b + 1}: mean length {table[-1][1]:.1f}, recall@20% {table[-1][3]:.2f} (random {baseline:.2f})", flush=True)
        ranker.observe(prompts, lengths)

    learned = [r for _, _, _, r, _ in table[1:]]
    lines = [
        "# Length ranker: recall of the longest 20% on real completions\n",
        f"`python benchmarks/bench_ranker.py --task {args.task} --batches {args.batches} --batch-size {args.batch_size}`: "
        f"tiny Llama warm-started on builtin:{args.task}, hf engine, temperature 1, at most {args.max_new_tokens} new "
        "tokens; the online ranker predicts each batch before it is generated, then learns from it.\n",
        "| batch | mean length | max length | online ranker recall@20% | random ranker |",
        "|---:|---:|---:|---:|---:|",
        *(f"| {b} | {m:.1f} | {mx} | {r:.2f} | {z:.2f} |" for b, m, mx, r, z in table),
        "",
        f"Mean recall@20% over batches 2-{args.batches} (after the first refit): **{sum(learned) / len(learned):.2f}** "
        f"(random: 0.2 expected).",
    ]
    publish_table(RESULTS, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
