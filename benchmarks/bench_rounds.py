"""F1 and F2 verdicts that hold up on a machine whose speed swings between runs.

On this 2-core VM one run of bench_engine.py can catch the bare loop in a fast phase and the
engine in a slow one, or the other way round: net with 2 rails measured 3.99 and then 1.88
GB/s for the same bare loop a minute apart. A ratio from one run is then a coin toss. So this
runs bench_engine.py `--rounds` times in a row, each run with its own deep bare loop
before and after its engine runs, and judges each case on the median of the per-round
ratios (engine over deep bare loop), printing every round's ratio beside it.

    .venv/bin/python benchmarks/bench_rounds.py --providers net --rails 1 \\
        --cases single:4K,single:16K,paged-random:4K --rounds 6

Writes benchmarks/results/<name>.json (every round's ratios, the medians and verdicts) and
<name>.png (ratios per round and their median, per case).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import bench_engine  # noqa: E402

NEED = bench_engine.DEEP_BARE_RATIO  # F1 and F2: at least this much of the deep bare loop


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="bench_engine.py runs, one after another (default 6)")
    p.add_argument("--providers", default="net", help="comma list of fabric providers (default net)")
    p.add_argument("--rails", default="1", help="comma list of rail counts (default 1)")
    p.add_argument("--cases", default="single:4K,single:16K,paged-random:4K,paged-random:16K",
                   help="bench_engine.py cases, single and paged-random only (adjacent pages have no bare loop)")
    p.add_argument("--repeats", type=int, default=3, help="timed engine runs per case in each round (default 3)")
    p.add_argument("--progress", default="thread",
                   help="bench_engine.py --progress: thread, caller, or both as a comma list (default thread)")
    p.add_argument("--name", default="bench_rounds", help="results/<name>.json and .png")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the results")
    return p.parse_args(argv)


def round_ratios(result: dict[str, Any]) -> dict[str, float]:
    """'<config label> | <kind> <size>' -> engine over deep bare loop, from one run's JSON."""
    out = {}
    for config in result["configs"]:
        for case in config["cases"]:
            if "x_bare_deep" in case:
                key = f"{config['label_short']} | {case['kind']} {bench_engine.size_text(case['size'])}"
                out[key] = case["x_bare_deep"]
    return out


def summarize(rounds: list[dict[str, float]]) -> list[dict[str, Any]]:
    """One row per case: its ratio in every round, their median, and the verdict."""
    rows = []
    for key in sorted({k for r in rounds for k in r}):
        ratios = [r[key] for r in rounds if key in r]
        median = statistics.median(ratios)
        rows.append({"case": key, "ratios": ratios, "median": median, "met": median >= NEED})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    width = max(len(r["case"]) for r in rows)
    print(f"{'case':<{width}}  median  verdict  ratios per round (engine / deep bare loop)")
    for r in rows:
        ratios = " ".join(f"{x:.2f}" for x in r["ratios"])
        print(f"{r['case']:<{width}}  {r['median']:6.2f}  {'ok' if r['met'] else 'LOW':>7}  {ratios}")
    low = [r["case"] for r in rows if not r["met"]]
    print(f"F1/F2 (median of rounds >= {NEED}): " + ("met by every case" if not low else f"NOT met: {low}"))


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(rows)), 4.5))
    for i, r in enumerate(rows):
        ax.scatter([i] * len(r["ratios"]), r["ratios"], color="tab:blue", alpha=0.5, s=18)
        ax.plot([i - 0.3, i + 0.3], [r["median"]] * 2, color="k")
    ax.axhline(NEED, color="tab:red", linestyle="--", label=f"target {NEED}x")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["case"].replace(" | ", "\n") for r in rows], fontsize=7)
    ax.set_ylabel("engine / deep bare loop (one dot per round, bar: median)")
    ax.set_title("F1/F2 over alternated rounds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="kvxfer-rounds-") as tmp:
        for r in tqdm(range(args.rounds), desc="rounds", unit="round"):
            name = f"round{r}"
            bench_engine.main(["--providers", args.providers, "--rails", args.rails, "--cases", args.cases,
                               "--repeats", str(args.repeats), "--progress", args.progress,
                               "--out", tmp, "--name", name, "--no-plot"])
            rounds.append(round_ratios(json.loads((Path(tmp) / f"{name}.json").read_text())))
    rows = summarize(rounds)
    print_table(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"argv": vars(args), "rounds": rounds, "rows": rows},
                                                      indent=2))
    plot(rows, out / f"{args.name}.png")
    print(f"wrote {out / args.name}.json and .png")
    return 0 if all(r["met"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
