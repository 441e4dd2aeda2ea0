"""A large dask DataFrame generated on the workers trains without reaching the client.

The acceptance's size: 8 partitions of 64 MiB each (16384 rows x 1024 float32 columns,
512 MiB in all), generated on two workers by ``dd.from_map`` and trained by
``DistributedTrainer.fit(ddf, features=..., labels=...)`` (parameter averaging, a
linear classifier, batch 512 per worker). Each repeat measures, on one cluster:

1. the client's peak resident-memory growth over the fit (sampled every 20 ms), in
   partitions (the rule: under 1.5);
2. the bytes the workers sent to anything that is not a worker (each worker's
   ``transfer_outgoing_log``: Dask's ``get_data`` to the client, or to the scheduler
   gathering for it), in partitions;
3. the fit's examples/s over the baseline: a bare ``jax.jit`` + optax loop on one
   generated partition in this process, warmed the same way, timed just before.

The test suite runs the same fit at 16 MiB a partition
(``tests/test_frames.py::test_a_frame_generated_on_the_workers_never_reaches_the_client``).

    python benchmarks/bench_frames.py                    # 8 x 64 MiB, 3 repeats
    python benchmarks/bench_frames.py --mib 16 --repeats 2
"""

import argparse
import os
import statistics
import sys
import threading
import time
import timeit

sys.path.insert(0, os.path.dirname(__file__))

WIDTH = 1024
BATCH = 512


def generated_partition(i, rows, width):
    """Runs on a worker: partition ``i``, ``rows`` x ``width`` float32 features and a 0/1 label."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(i)
    x = rng.normal(size=(rows, width)).astype(np.float32)
    df = pd.DataFrame(x, columns=[f"f{j}" for j in range(width)])
    df["y"] = (x[:, 0] > 0).astype(np.int64)
    return df


def _linear(width):
    import jax.numpy as jnp
    import numpy as np

    import dlspark

    def init(rng, x):
        return {"w": jnp.zeros((x.shape[-1], 2))}

    def apply(v, x, train, rng):
        return x @ v["w"]

    return dlspark.Model(init, apply, np.zeros((1, width), np.float32)), init, apply


class _PeakRSS:
    """The process's peak resident memory above where it started, sampled every 20 ms."""

    def __init__(self):
        import psutil

        self._proc = psutil.Process(os.getpid())
        self.start = self._proc.memory_info().rss
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def grew(self):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        return self.peak - self.start


def _sent_to_non_workers(client):
    workers = set(client.scheduler_info()["workers"])
    logs = client.run(lambda dask_worker: [(e["who"], e["total"]) for e in dask_worker.transfer_outgoing_log])
    return sum(total for log in logs.values() for who, total in log if who not in workers)


def plain_examples_per_second(rows, width, epochs=1):
    """The baseline: a bare jitted optax loop over one generated partition, in this process."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    part = generated_partition(0, rows, width)
    x = part.drop(columns="y").to_numpy(np.float32)
    y = part["y"].to_numpy(np.int32)
    tx = optax.sgd(0.01)

    def loss_fn(w, xb, yb):
        return optax.softmax_cross_entropy_with_integer_labels(xb @ w, yb).mean()

    @jax.jit
    def step(w, s, xb, yb):
        loss, g = jax.value_and_grad(loss_fn)(w, xb, yb)
        u, s = tx.update(g, s, w)
        return optax.apply_updates(w, u), s, loss

    w = jnp.zeros((width, 2))
    s = tx.init(w)
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, rows - rows % BATCH, BATCH)]
    w, s, loss = step(w, s, *batches[0])  # warm: compiled
    loss.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(epochs):
        for xb, yb in batches:  # host arrays, moved to the device each step, as a worker's are
            w, s, loss = step(w, s, xb, yb)
    loss.block_until_ready()
    return epochs * len(batches) * BATCH / (time.perf_counter() - t0)


def measure(mib=64, n_parts=8, repeats=3, workers=2):
    import dask.dataframe as dd
    import optax
    from distributed import Client

    import dlspark
    from dlspark.cluster import local_cluster

    rows = mib * 2**20 // (WIDTH * 4)
    part_bytes = rows * WIDTH * 4
    meta = generated_partition(0, 0, WIDTH)
    cols = [f"f{j}" for j in range(WIDTH)]
    out = {"growth_partitions": [], "sent_partitions": [], "fit_s": [], "examples_per_s": [], "over_plain": []}
    with local_cluster(workers) as cluster, Client(cluster) as client:
        model, _, _ = _linear(WIDTH)
        net = dlspark.Network(model, updater=optax.sgd(0.01))
        trainer = dlspark.DistributedTrainer(client, net, dlspark.ParameterAveraging(
            batch_size_per_worker=BATCH, averaging_frequency=4), progress=False)
        small = dd.from_map(generated_partition, [100, 101], rows=BATCH, width=WIDTH, meta=meta)
        trainer.fit(small, features=cols, labels="y")  # warm: imports and compiled programs on the workers
        for r in range(repeats):
            plain = plain_examples_per_second(rows, WIDTH)
            ddf = dd.from_map(generated_partition, [1000 * r + i for i in range(n_parts)], rows=rows, width=WIDTH,
                              meta=meta)
            sent0 = _sent_to_non_workers(client)
            rss = _PeakRSS()
            t0 = timeit.default_timer()
            trainer.fit(ddf, features=cols, labels="y")
            fit_s = timeit.default_timer() - t0
            grew = rss.grew()
            sent = _sent_to_non_workers(client) - sent0
            eps = n_parts * (rows - rows % BATCH) / fit_s
            out["growth_partitions"].append(grew / part_bytes)
            out["sent_partitions"].append(sent / part_bytes)
            out["fit_s"].append(fit_s)
            out["examples_per_s"].append(eps)
            out["over_plain"].append(eps / plain)
        trainer.close()
    return {"partition_mib": part_bytes / 2**20, "partitions": n_parts, **out}


def _spread(xs):
    return f"{statistics.median(xs):.4g} [{min(xs):.4g}-{max(xs):.4g}]"


class FrameNeverReachesTheClient:
    """asv: the client's peak growth over the fit, in 64 MiB partitions (the rule: under 1.5)."""

    timeout = 1200
    timer = timeit.default_timer
    unit = "partitions"

    def track_client_growth(self):
        return statistics.median(measure(repeats=1)["growth_partitions"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB a partition")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    res = measure(args.mib, args.partitions, args.repeats)
    print(f"{res['partitions']} partitions of {res['partition_mib']:.0f} MiB on 2 workers, "
          f"median [min-max] of {args.repeats}:")
    for key in ("growth_partitions", "sent_partitions", "fit_s", "examples_per_s", "over_plain"):
        print(f"  {key:18s} {_spread(res[key])}")
