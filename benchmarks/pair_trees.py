"""Old code against new: a benchmark's figures from two source trees, alternated, as paired ratios.

Each pair runs the benchmark once from the old tree and once from the new (which one goes first
alternates from pair to pair), each in a fresh process with that tree first on ``PYTHONPATH``
and the tree's own copy of the benchmark; a figure of the new run over the same figure of the
old run is one paired ratio. The report gives, per figure, the median paired ratio with a 90%
bootstrap interval of that median (resampling the pairs), and every pair's values, so that a
drift of the machine during the call moves both sides of a pair alike.

    git worktree add /tmp/old 617eb9a
    python benchmarks/pair_trees.py --old /tmp/old --new . --pairs 9 \\
        --out docs/_data/pair_trees.json -- efficiency averaging sharing mlp

Benchmarks (the part after ``--``): ``efficiency [ALGORITHM ...] [KIND ...]`` (``bench_efficiency.py``,
the ``efficiency`` and ``efficiency_over_bound`` of each measurement) and ``parallel KIND`` (``bench_parallel.py``, the
``efficiency`` of each of its measurements, named by algorithm and fusing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np


def _parse_efficiency(out: str) -> dict:
    figures = {}
    for line in out.splitlines():
        if line.startswith("algorithm="):
            f = dict(kv.split("=", 1) for kv in line.split())
            name = f"{f['algorithm']}-{f['network']}"
            figures[f"{name} efficiency"] = float(f["efficiency"])
            figures[f"{name} efficiency_over_bound"] = float(f["efficiency_over_bound"])
    if not figures:
        raise RuntimeError("bench_efficiency.py printed no result line:\n" + out[-2000:])
    return figures


def _parse_parallel(out: str) -> dict:
    figures = {}
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        name = r.get("algorithm", "averaging")
        if name == "averaging":
            name += "-fused" if r.get("fused_steps", True) else "-unfused"
        figures[f"{name} efficiency"] = float(r["efficiency"])
    if not figures:
        raise RuntimeError("bench_parallel.py printed no result line:\n" + out[-2000:])
    return figures


BENCHMARKS = {"efficiency": ("bench_efficiency.py", _parse_efficiency),
              "parallel": ("bench_parallel.py", _parse_parallel)}


def run_once(tree: str, bench: list, timeout: float) -> dict:
    script, parse = BENCHMARKS[bench[0]]
    tree = os.path.abspath(tree)
    env = dict(os.environ, PYTHONPATH=tree, PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, os.path.join(tree, "benchmarks", script), *bench[1:]], cwd=tree, env=env,
                       capture_output=True, text=True, timeout=timeout, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{script} from {tree} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return parse(p.stdout)


def bootstrap_median(ratios, level=0.90, draws=10000, seed=0) -> tuple:
    """The median of ``ratios`` and a percentile bootstrap interval of it."""
    x = np.asarray(ratios, dtype=float)
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(x, size=(draws, len(x)), replace=True), axis=1)
    lo, hi = np.quantile(medians, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(np.median(x)), float(lo), float(hi)


def table(report: dict) -> dict:
    """The report's figures as one table in ``docs/_data``'s shape."""
    rows = [[name, f"{f['old_median']:.3f}", f"{f['new_median']:.3f}",
             f"{f['median_ratio']:.3f} ({f['interval_90'][0]:.3f}-{f['interval_90'][1]:.3f})", len(f["ratios"])]
            for name, f in report["figures"].items()]
    return {"title": f"{' '.join(report['benchmark'])}: the new tree against the old, alternated pairs",
            "columns": ["figure", "old (median)", "new (median)", "new/old, median paired ratio (90% bootstrap interval)",
                        "pairs"], "rows": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the old source tree (a git worktree)")
    ap.add_argument("--new", required=True, help="the new source tree")
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--timeout", type=float, default=900, help="seconds for one run of the benchmark")
    ap.add_argument("--out", help="write the report as JSON here")
    ap.add_argument("bench", nargs="+", help="efficiency [ALGORITHM ...] [KIND ...] | parallel [KIND ...]")
    a = ap.parse_args(argv)
    if a.bench[0] not in BENCHMARKS:
        ap.error(f"the benchmark must be one of {sorted(BENCHMARKS)}, got {a.bench[0]!r}")
    pairs = []
    t0 = time.time()
    for i in range(a.pairs):
        order = ("old", "new") if i % 2 == 0 else ("new", "old")
        pair = {"first": order[0]}
        for side in order:
            pair[side] = run_once(a.old if side == "old" else a.new, a.bench, a.timeout)
        pairs.append(pair)
        print(json.dumps(pair), flush=True)
    report = {"benchmark": a.bench, "old": os.path.abspath(a.old), "new": os.path.abspath(a.new),
              "pairs": pairs, "seconds": round(time.time() - t0, 1), "figures": {}}
    for name in pairs[0]["new"]:
        ratios = [p["new"][name] / p["old"][name] for p in pairs]
        med, lo, hi = bootstrap_median(ratios)
        report["figures"][name] = {"median_ratio": med, "interval_90": [lo, hi], "ratios": ratios,
                                   "old_median": statistics.median(p["old"][name] for p in pairs),
                                   "new_median": statistics.median(p["new"][name] for p in pairs)}
        print(f"{name}: new/old median {med:.3f} (90% bootstrap interval {lo:.3f}-{hi:.3f}) over {len(pairs)} pairs")
    report["tables"] = [table(report)]
    if a.out:
        with open(a.out + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(a.out + ".tmp", a.out)
    return report


if __name__ == "__main__":
    main()
