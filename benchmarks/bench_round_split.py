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
import time

sys.path.insert(0, os.path.dirname(__file__))


def split(stats, seconds):
    """One fit's time split by its round statistics (see the module's docstring)."""
    steps = sum(s["fit_time_max"] for s in stats)
    mean = sum(s.get("avg_time", 0.0) for s in stats)
    hidden = sum(min(s["fit_time_max"], s.get("avg_time", 0.0)) for s in stats[1:])
    return {"fit_s": seconds, "rounds": len(stats), "steps_s": steps, "mean_s": mean,
            "fetch_s": sum(s.get("fetch_time", 0.0) for s in stats), "other_s": seconds - steps - mean,
            "hidden_at_most_s": hidden, "bound_fit_s": seconds - hidden}


def _spread(values, fmt):
    values = sorted(values)
    return f"{fmt(values[len(values) // 2])} ({fmt(values[0])}-{fmt(values[-1])})"


def document(results, a, load):
    """The splits in ``docs/_data``'s shape: one table row per rate (medians, min-max), and the fits."""
    import platform

    rows = []
    for rate, fits in results.items():
        def col(k, fmt="{:.2f}".format, fits=fits):
            return _spread([f[k] for f in fits], fmt)

        rows.append([rate, len(fits), col("fit_s"), col("steps_s"), col("mean_s"), col("hidden_at_most_s"),
                     col("over_plain", "{:.2f}x".format), col("bound_over_plain", "{:.2f}x".format)])
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


def measure(address, examples, epochs, runs):
    """``runs`` timed fits' splits on the cluster at ``address``, after a warm fit."""
    import bench_network as bn
    import optax
    from distributed import Client

    import dlspark

    x, y = bn._data(examples)
    data = dlspark.DataSet(x, y)
    with Client(address) as client:
        net = dlspark.Network(dlspark.Model.from_flax(bn._flax_mlp(), x[:1]), updater=optax.adam(bn.LR))
        with dlspark.DistributedTrainer(client, net, bn._master("averaging5"), progress=False) as trainer:
            trainer.fit(data, epochs=epochs)  # warm: compiles, exports
            out = []
            for _ in range(runs):
                t0 = time.perf_counter()
                trainer.fit(data, epochs=epochs)
                out.append(split(trainer.last_fit_stats, time.perf_counter() - t0))
    return out


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
    import bench_network as bn

    from dlspark.testing import emulated_cluster

    results = {}
    for rate in a.rates:
        before = bn.run_plain(a.examples, a.epochs)
        with emulated_cluster(2, rate=rate, env={"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}) as net:
            fits = measure(net.scheduler_address, a.examples, a.epochs, a.runs)
        plain = (before + bn.run_plain(a.examples, a.epochs)) / 2  # examples/s
        trained = a.examples * a.epochs
        for f in fits:
            f.update(plain_examples_per_s=plain, over_plain=trained / f["fit_s"] / plain,
                     bound_over_plain=trained / f["bound_fit_s"] / plain)
        results[rate] = fits
        for f in results[rate]:
            print(rate, " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in f.items()),
                  flush=True)
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(document(results, a, os.getloadavg()), f, indent=1)
        os.replace(tmp, a.out)

if __name__ == "__main__":
    main()
