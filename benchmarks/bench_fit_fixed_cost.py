"""The fixed cost of a warm ``fit`` call against one Dask task round trip, measured in the same run.

A 2-worker LocalCluster, a tiny network (its step is noise), one minibatch per worker:
what a ``fit`` costs beyond its steps (exporting or finding the exported files,
setting the job up on the workers, its control messages, bringing the state
back). The baseline is ``client.submit(noop).result()``, one task round trip.

    python benchmarks/bench_fit_fixed_cost.py
"""

import statistics
import time
import timeit


def _noop():
    return None


def measure(repeats=30):
    import flax.linen as nn
    import numpy as np
    import optax
    from distributed import Client

    import dlspark
    from dlspark.cluster import local_cluster

    tr, _ = dlspark.datasets.digits()
    data = tr[:64]  # one minibatch of 32 per worker
    with local_cluster(2) as cluster, Client(cluster) as client:
        net = dlspark.Network(dlspark.Model.from_flax(nn.Dense(10), np.zeros((1, 64), np.float32)),
                              updater=optax.sgd(0.1))
        trainer = dlspark.DistributedTrainer(client, net, dlspark.ParameterAveraging(batch_size_per_worker=32),
                                             progress=False)
        for _ in range(3):  # compile, export, warm the connections
            trainer.fit(data)
            client.submit(_noop, pure=False).result()
        fits, trips = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            trainer.fit(data)
            fits.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            client.submit(_noop, pure=False).result()
            trips.append(time.perf_counter() - t0)
        trainer.close()
    return {"fit_ms": [1e3 * f for f in fits], "round_trip_ms": [1e3 * t for t in trips],
            "ratio": [f / t for f, t in zip(fits, trips)]}


class FitFixedCost:
    """asv: a warm fit's wall time over one task round trip (a ratio, lower is better)."""

    timeout = 300
    timer = timeit.default_timer
    unit = "ratio"

    def setup_cache(self):
        return measure()

    def track_fit_over_task_round_trip(self, results):
        return statistics.median(results["ratio"])


if __name__ == "__main__":
    r = measure()
    for k in ("fit_ms", "round_trip_ms", "ratio"):
        v = sorted(r[k])
        print(f"{k}: median {statistics.median(v):.2f}, quartiles {v[len(v) // 4]:.2f}-{v[3 * len(v) // 4]:.2f}")
