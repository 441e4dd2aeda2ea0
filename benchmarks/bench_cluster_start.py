"""Starting the embedded cluster: ``local_cluster`` against Dask's plain ``LocalCluster``.

A cluster is ready when its workers can run a dlspark task: each has imported JAX and
dlspark's worker side. Timed from the call that starts the cluster to the return of a
``client.run`` that imports them on every worker, in a fresh Python process per repeat
(the client's own imports done before the clock starts), twice in that process: the first
start of a process (for the fork server, its own start too) and a second one. Contenders:

- ``dask``: ``distributed.LocalCluster(n, threads_per_worker=1, processes=True)``, Dask's
  defaults otherwise (workers spawned), the baseline;
- ``spawn``: ``local_cluster(n, start_method="spawn")``;
- ``forkserver``: ``local_cluster(n)``, CPU workers forked from a server that has imported
  JAX and dlspark (the default on Linux).

Each figure is a median over repeats with its range, and each contender's time over the
baseline's in the same repeat. ``cpu_s`` is the workers' own CPU time at that point (a forked
worker's excludes what the server spent once). Print them with ``python
benchmarks/bench_cluster_start.py [--workers N] [--repeats R]``.
"""

import json
import os
import statistics
import subprocess
import sys

CONTENDERS = ("dask", "spawn", "forkserver")

_CHILD = r"""
import json, resource, sys, time

def imported():
    import dlspark.distributed._worker  # JAX, optax, flax and dlspark: what a task of a fit needs first
    return resource.getrusage(resource.RUSAGE_SELF)

if __name__ == "__main__":
    import dlspark.distributed._worker  # noqa: F401 (the client's imports, outside the clock)
    from distributed import Client, LocalCluster
    from dlspark.cluster import local_cluster

    contender, n = sys.argv[1], int(sys.argv[2])
    out = []
    for _ in range(2):
        t = time.perf_counter()
        if contender == "dask":
            cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None)
        else:
            cluster = local_cluster(n, start_method=contender)
        with cluster, Client(cluster) as client:
            usage = client.run(imported)
            out.append({"seconds": time.perf_counter() - t,
                        "cpu_s": sum(u.ru_utime + u.ru_stime for u in usage.values())})
    print(json.dumps(out))
"""


def start_once(contender: str, workers: int) -> list:
    """``[first, second]``: the two starts of one fresh process, each ``{"seconds", "cpu_s"}``."""
    r = subprocess.run([sys.executable, "-c", _CHILD, contender, str(workers)], capture_output=True, text=True,
                       timeout=600, cwd=os.path.dirname(os.path.abspath(__file__)))
    if r.returncode:
        raise RuntimeError(f"{contender} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _spread(values) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(workers: int = 2, repeats: int = 5) -> dict:
    runs = {c: [] for c in CONTENDERS}
    for _ in range(repeats):  # interleaved, so that drift reaches every contender alike
        for c in CONTENDERS:
            runs[c].append(start_once(c, workers))
    out = {"workers": workers, "repeats": repeats, "contenders": {}}
    for c in CONTENDERS:
        out["contenders"][c] = {
            which: {"seconds": _spread([r[i]["seconds"] for r in runs[c]]),
                    "cpu_s": _spread([r[i]["cpu_s"] for r in runs[c]]),
                    "over_dask": _spread([r[i]["seconds"] / b[i]["seconds"] for r, b in zip(runs[c], runs["dask"])])}
            for i, which in enumerate(("first", "second"))}
    return out


class TrackClusterStart:
    """asv: a 2-worker cluster's start, ready for a dlspark task, over Dask's plain
    ``LocalCluster`` (lower is better)."""

    params = (["spawn", "forkserver"], ["first", "second"])
    param_names = ["start_method", "start"]
    unit = "ratio"
    timeout = 600

    def setup_cache(self):
        return measure(2, repeats=3)

    def track_over_dask(self, cache, start_method, start):
        return cache["contenders"][start_method][start]["over_dask"]["median"]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    result = measure(args.workers, args.repeats)
    for c, starts in result["contenders"].items():
        for which, r in starts.items():
            s, cpu, ratio = r["seconds"], r["cpu_s"], r["over_dask"]
            print(f"{c:10s} {which:6s} {s['median']:5.2f} s ({s['min']:.2f}-{s['max']:.2f}), workers' CPU "
                  f"{cpu['median']:5.2f} s ({cpu['min']:.2f}-{cpu['max']:.2f}), over dask {ratio['median']:.2f} "
                  f"({ratio['min']:.2f}-{ratio['max']:.2f})")
    print(json.dumps(result))
