"""Keyed inference throughput on 2 workers over the plain-process forward pass.

figure = (examples/s of ``predict_with_keys`` on 2 workers, median of 3 calls) /
(2 x examples/s of the same jitted forward pass in a plain process pinned to
one core; each worker is pinned to one core too).
Print it with ``python benchmarks/bench_inference.py``.
"""

import os
import subprocess
import sys
import textwrap
import time
import timeit

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

from _common import make_network  # noqa: E402

N, BATCH, KIND = 40_000, 256, "mlp"
#: keyed-inference calls timed; the figure uses the median
REPEAT = 3


def plain_examples_per_second(n=N, batch=BATCH, kind=KIND):
    code = textwrap.dedent(f"""
        import os, sys, time
        os.sched_setaffinity(0, {{0}})
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import numpy as np
        from _common import make_network, NETWORKS
        net = make_network({kind!r})
        x = np.random.default_rng(0).random(({n}, NETWORKS[{kind!r}][1])).astype(np.float32)
        net.output(x[:{batch}], batch_size={batch})
        t0 = time.perf_counter()
        net.output(x, batch_size={batch})
        print({n} / (time.perf_counter() - t0))
    """)
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def measure(n=N, batch=BATCH, kind=KIND, workers=2):
    from distributed import Client

    import dlspark
    from dlspark.cluster import local_cluster
    from dlspark.distributed._worker import DlsparkWorkerPlugin

    from _common import NETWORKS

    before = plain_examples_per_second(n, batch, kind)
    x = np.random.default_rng(1).random((n, NETWORKS[kind][1])).astype(np.float32)
    pairs = [(i, x[i]) for i in range(n)]
    with local_cluster(workers) as cluster, Client(cluster) as client:
        client.register_plugin(DlsparkWorkerPlugin(pin_cores=True, n_workers=workers, cores_per_worker=1))
        trainer = dlspark.DistributedTrainer(client, make_network(kind), progress=False)
        trainer.predict_with_keys(pairs[: 4 * batch], batch_size=batch)  # compile on every worker
        times = []
        for _ in range(REPEAT):
            t0 = time.perf_counter()
            trainer.predict_with_keys(pairs, batch_size=batch)
            times.append(time.perf_counter() - t0)
        job = n / sorted(times)[len(times) // 2]
    after = plain_examples_per_second(n, batch, kind)
    plain = (before + after) / 2
    return {"job_examples_per_s": job, "plain_examples_per_s": plain, "ratio_to_2x_plain": job / (workers * plain),
            "plain_drift": after / before}


class KeyedInference:
    """asv: the ratio is the figure."""

    timeout = 300
    timer = timeit.default_timer
    unit = "ratio"

    def track_ratio_to_2x_plain(self):
        return measure()["ratio_to_2x_plain"]


if __name__ == "__main__":
    print(" ".join(f"{k}={v:.3f}" for k, v in measure().items()))
