"""Where parameter averaging's rounds spend their time on separate emulated hosts, and what a
round's exchange overlapped with the next round's steps could save at most.

The network benchmark's job (:mod:`bench_network`: two workers, each in a network namespace of
its own with its link rate-limited in both directions, the 320-640-640-640-10 MLP with Adam,
128 examples a step per worker, 16,000 examples for 2 epochs) with averaging's defaults
(frequency 5, the updater's state averaged). After a warm fit, each timed fit's round
statistics split it into the workers' steps (the slowest worker's, ``fit_time_max``) and the
mean (``avg_time``: fetching the peer's contribution and averaging). An averaging that applied
each round's mean a round late (the parity suite's ``averaging-late``) would run a round's
exchange beside the next round's steps: it hides at most ``min(steps, mean)`` of each round but
the last, whose mean the fit waits for. ``bound_fit_s`` is the fit's time less that: the
fastest such a fit could be, with nothing else changed. Both are also given as examples/s over
one plain ``jax.jit`` + optax process pinned to one core, run before and after each rate's fits
(:func:`bench_network.run_plain`, their mean).

Run (root and iproute2, as :func:`dlspark.testing.emulated_cluster` needs)::

    python benchmarks/bench_round_split.py --rates unlimited 1gbit --runs 3 --out split.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import bench_network as bn  # noqa: E402


def split(stats, seconds):
    """One fit's time split by its round statistics (see the module's docstring)."""
    steps = sum(s["fit_time_max"] for s in stats)
    mean = sum(s.get("avg_time", 0.0) for s in stats)
    hidden = sum(min(s["fit_time_max"], s.get("avg_time", 0.0)) for s in stats[1:])
    return {"fit_s": seconds, "rounds": len(stats), "steps_s": steps, "mean_s": mean,
            "fetch_s": sum(s.get("fetch_time", 0.0) for s in stats), "other_s": seconds - steps - mean,
            "hidden_at_most_s": hidden, "bound_fit_s": seconds - hidden}


def _seconds(values):
    s = bn._spread(values)
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def document(results, load):
    """The splits in ``docs/_data``'s shape: one table row per rate (medians, min-max), and the fits."""
    import platform

    rows = []
    for rate, fits in results.items():
        def col(k, fits=fits):
            return [f[k] for f in fits]

        rows.append([rate, len(fits), *(_seconds(col(k)) for k in ("fit_s", "steps_s", "mean_s", "hidden_at_most_s")),
                     bn._ratio(bn._spread(col("over_plain"))), bn._ratio(bn._spread(col("bound_over_plain")))])
    return {"suite": "averaging's rounds split",
            "command": "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]]),
            "machine": f"{os.cpu_count()} cores ({platform.machine()}), Python {platform.python_version()}; "
                       f"load average {load[0]:.2f} at the end",
            "source": "benchmarks/bench_round_split.py: trainer.last_fit_stats of each timed fit",
            "tables": [{"title": "Default averaging on two emulated hosts: a fit's seconds, median (min-max)",
                        "columns": ["link", "fits", "fit", "steps (slowest worker)", "mean (fetch and average)",
                                    "hidden at most by a late mean", "over the plain process",
                                    "the bound over the plain process"],
                        "rows": rows}],
            "results": results}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", nargs="+", default=["unlimited", "1gbit"])
    p.add_argument("--examples", type=int, default=16000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=None, help="write the splits as JSON here")
    a = p.parse_args(argv)
    if a.runs < 1:
        p.error(f"--runs must be at least 1, got {a.runs}")
    from distributed import Client

    from dlspark.testing import emulated_cluster

    results = {}
    for rate in a.rates:
        before = bn.run_plain(a.examples, a.epochs)
        with emulated_cluster(2, rate=rate, env={"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}) as net, \
                Client(net.scheduler_address) as client:
            r = bn.run_dlspark(net, client, "averaging5", a.examples, a.epochs, a.runs)  # after a warm fit
        plain = (before + bn.run_plain(a.examples, a.epochs)) / 2  # examples/s
        fits = [split(stats, seconds) for stats, seconds in zip(r["round_stats"], r["seconds"], strict=True)]
        for f in fits:
            f.update(plain_examples_per_s=plain, over_plain=r["examples"] / f["fit_s"] / plain,
                     bound_over_plain=r["examples"] / f["bound_fit_s"] / plain)
        results[rate] = fits
        for f in fits:
            print(rate, " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in f.items()),
                  flush=True)
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(document(results, os.getloadavg()), f, indent=1)
        os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
