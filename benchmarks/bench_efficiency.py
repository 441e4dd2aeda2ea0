"""Per-worker efficiency of parameter averaging and gradient sharing on a 2-worker LocalCluster.

efficiency = (steps/s of one worker inside the job) / (steps/s of the plain
jitted optax step of the same model and updater, ``_common.plain_optax_step``,
in a plain process pinned to one core). Each worker is pinned to
one core too. Both sides are measured in the same run. A second figure,
``efficiency_vs_concurrent``, divides by plain processes run side by side on
the workers' cores, so that the machine is as loaded as during the job. A
third, ``cluster_bound``, is the same plain step run as a task in both workers
at once, over the plain process: the efficiency of a job that did no
distributed-training work at all, i.e. what the cluster itself leaves.
Print them with ``python benchmarks/bench_efficiency.py [averaging|sharing] [mlp|cnn]``.
"""

import os
import sys
import timeit

sys.path.insert(0, os.path.dirname(__file__))

from _common import (in_cluster_steps_per_second, make_data, make_master, make_network,  # noqa: E402
                     plain_concurrent_steps_per_second, plain_steps_per_second)

#: network -> minibatch size giving a plain step of roughly 10-13 ms on one core here
BATCH = {"mlp": 160, "cnn": 16}
FREQ = 5


def measure(kind="mlp", n_rounds=40, workers=2, freq=FREQ, approach="export", algorithm="averaging"):
    from distributed import Client

    import dlspark
    from dlspark.cluster import local_cluster
    from dlspark.distributed._worker import DlsparkWorkerPlugin

    batch = BATCH[kind]
    data = make_data(batch * freq * workers * n_rounds, kind)
    # The baseline is measured before and after the job and averaged: the
    # machine is shared, and its speed drifts within a run.
    before, _ = plain_steps_per_second(kind, batch)
    with local_cluster(workers) as cluster, Client(cluster) as client:
        client.register_plugin(DlsparkWorkerPlugin(pin_cores=True, n_workers=workers, cores_per_worker=1))
        net = make_network(kind)
        sharing = {"steps_per_round": 4 * freq} if algorithm == "sharing" else {}
        master = make_master(algorithm, batch, freq, approach, **sharing)
        trainer = dlspark.DistributedTrainer(client, net, master, progress=False)
        # A short fit first warms the worker processes (compilation, first-touch page
        # faults of their memory), as the plain baseline's first steps do.
        trainer.fit(make_data(batch * freq * workers * 4, kind))
        trainer.fit(data)
        stats = trainer.last_fit_stats[2:]  # rounds 1-2 of a job include its set-up
        steps = sum(s["minibatches"] for s in stats) / workers
        wall = sum(s["round_time"] for s in stats)
        fit = sum(max(s["worker_fit_time"].values()) for s in stats)
        avg = sum(s["avg_time"] for s in stats)
        fetch = sum(s["fetch_time"] for s in stats)
        trainer.close()
        bound = in_cluster_steps_per_second(client, kind, batch)
    job_rate = steps / wall
    after, cpu = plain_steps_per_second(kind, batch)
    plain_rate = (before + after) / 2
    concurrent = plain_concurrent_steps_per_second(kind, batch, cores=tuple(range(workers)))
    return {"algorithm": algorithm, "network": kind, "params": net.num_params, "job_steps_per_s": job_rate, "plain_steps_per_s": plain_rate, "efficiency": job_rate / plain_rate,
            "efficiency_vs_concurrent": job_rate / concurrent, "cluster_bound": bound / plain_rate,
            "plain_step_ms": 1000 / plain_rate, "plain_drift": after / before, "plain_cpu_per_wall": cpu,
            "fit_share": fit / wall, "avg_share": avg / wall, "fetch_share": fetch / wall}


class ParameterAveragingEfficiency:
    """asv: the ratio is the figure (``track_``), not an absolute time."""

    timeout = 300
    timer = timeit.default_timer
    unit = "ratio"

    params = ["mlp", "cnn"]
    param_names = ["network"]

    def track_efficiency_2_workers(self, kind):
        return measure(kind)["efficiency"]


class GradientSharingEfficiency(ParameterAveragingEfficiency):
    def track_efficiency_2_workers(self, kind):
        return measure(kind, algorithm="sharing")["efficiency"]


if __name__ == "__main__":
    algorithms = [a for a in sys.argv[1:] if a in ("averaging", "sharing")] or ["averaging", "sharing"]
    kinds = [a for a in sys.argv[1:] if a in ("mlp", "cnn")] or ["mlp", "cnn"]
    for algorithm, kind in [(a, k) for a in algorithms for k in kinds]:
        r = measure(kind, algorithm=algorithm)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
