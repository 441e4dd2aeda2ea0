"""Per-worker efficiency of parameter averaging and gradient sharing on a 2-worker LocalCluster.

efficiency = (steps/s of one worker inside the job) / (steps/s of the plain
jitted optax step of the same model and updater, ``_common.plain_optax_step``,
in a plain process pinned to one core). Each worker is pinned to
one core too. Both sides are measured in the same run, interleaved: the job
runs in four segments, and each divides by the baseline timed just before
and just after it; the figure is the median segment, with the range. A second figure,
``efficiency_vs_concurrent``, divides by plain processes run side by side on
the workers' cores, so that the machine is as loaded as during the job. A
third, ``cluster_bound``, is the same plain step run as a task in both workers
at once, over the plain process: the efficiency of a job that did no
distributed-training work at all, i.e. what the cluster itself leaves. The
fourth, ``efficiency_over_bound``, is the job's steps/s per worker over that
in-cluster step's, measured on the same cluster just before and just after
each segment (median segment, with the range): what the job keeps of what
the cluster leaves, with the plain process out of the quotient.
Print them with ``python benchmarks/bench_efficiency.py [averaging|sharing] [mlp|cnn] [sgd|adam]``
(SGD by default; with Adam the job's state, and so what a round moves, is three times the
parameters, and the baselines take Adam's step too).
"""

import os
import sys
import timeit

sys.path.insert(0, os.path.dirname(__file__))

from _common import (PlainProcess, in_cluster_steps_per_second, make_data, make_master, make_network,  # noqa: E402
                     plain_concurrent_steps_per_second)

#: network -> minibatch size giving a plain step of roughly 10-13 ms on one core here
BATCH = {"mlp": 160, "cnn": 16}
FREQ = 5


def measure(kind="mlp", n_rounds=80, workers=2, freq=FREQ, approach="export", algorithm="averaging", segments=4,
            updater="sgd", batch=None, client_cores=None):
    """The job runs as ``segments`` fits of ``n_rounds / segments`` rounds on one trainer; a warm
    baseline process (:class:`_common.PlainProcess`, pinned to the first worker's core and idle
    meanwhile) is timed before the first and after each. Each segment's efficiency divides by
    the mean of the baseline just before and just after it, since this machine's speed drifts
    by 10% within a minute; ``efficiency`` is their median, with their range beside it.
    ``batch`` overrides the network's minibatch size (:data:`BATCH`). With ``client_cores`` the
    client's process (which also runs the scheduler and the nannies) moves onto those cores once
    the workers have pinned themselves to the first ``workers`` cores of those it had, and comes
    back when the measurement ends."""
    import statistics

    from distributed import Client

    import dlspark
    from dlspark.cluster import local_cluster
    from dlspark.distributed._worker import DlsparkWorkerPlugin, pin_process

    own_cores = os.sched_getaffinity(0) if client_cores is not None else None
    batch = batch or BATCH[kind]
    data = make_data(batch * freq * workers * (n_rounds // segments), kind)
    with PlainProcess(kind, batch, updater=updater) as plain:
        with local_cluster(workers) as cluster, Client(cluster) as client:
            client.register_plugin(DlsparkWorkerPlugin(pin_cores=True, n_workers=workers, cores_per_worker=1))
            if client_cores is not None:  # workers spawned later would inherit these cores: restored below
                pin_process(set(client_cores))
            net = make_network(kind, updater)
            sharing = {"steps_per_round": 4 * freq} if algorithm == "sharing" else {}
            master = make_master(algorithm, batch, freq, approach, **sharing)
            trainer = dlspark.DistributedTrainer(client, net, master, progress=False)
            # A short fit first warms the worker processes (compilation, first-touch page
            # faults of their memory), as the baseline's first steps do.
            trainer.fit(make_data(batch * freq * workers * 4, kind))
            plain_rates, cpu = [plain.rate()[0]], []
            bounds, over_bound = [in_cluster_steps_per_second(client, kind, batch, updater=updater)], []
            ratios, steps, wall, fit, avg, fetch = [], 0.0, 0.0, 0.0, 0.0, 0.0
            for _ in range(segments):
                trainer.fit(data)
                stats = trainer.last_fit_stats[2:]  # rounds 1-2 of a job include its set-up
                seg_steps = sum(s["minibatches"] for s in stats) / workers
                seg_wall = sum(s["round_time"] for s in stats)
                rate, c = plain.rate()
                plain_rates.append(rate)
                cpu.append(c)
                ratios.append(seg_steps / seg_wall / ((plain_rates[-2] + plain_rates[-1]) / 2))
                bounds.append(in_cluster_steps_per_second(client, kind, batch, updater=updater))
                over_bound.append(seg_steps / seg_wall / ((bounds[-2] + bounds[-1]) / 2))
                steps, wall = steps + seg_steps, wall + seg_wall
                fit += sum(max(s["worker_fit_time"].values()) for s in stats)
                avg += sum(s["avg_time"] for s in stats)
                fetch += sum(s["fetch_time"] for s in stats)
            trainer.close()
            bound = statistics.mean(bounds)
        if client_cores is not None:
            pin_process(own_cores)
        job_rate = steps / wall
        plain_rate = statistics.mean(plain_rates)
        # the warm baseline stands for the first worker's core among those run side by side
        concurrent = plain_concurrent_steps_per_second(kind, batch, cores=tuple(range(workers)), updater=updater,
                                                       warm=plain)
    return {"algorithm": algorithm, "network": kind, "updater": updater, "params": net.num_params,
            "job_steps_per_s": job_rate, "plain_steps_per_s": plain_rate, "efficiency": statistics.median(ratios),
            "efficiency_min": min(ratios), "efficiency_max": max(ratios),
            "efficiency_vs_concurrent": job_rate / concurrent, "cluster_bound": bound / plain_rate,
            "efficiency_over_bound": statistics.median(over_bound), "over_bound_min": min(over_bound),
            "over_bound_max": max(over_bound),
            "plain_step_ms": 1000 / plain_rate, "plain_drift": max(plain_rates) / min(plain_rates),
            "plain_cpu_per_wall": statistics.mean(cpu),
            "fit_share": fit / wall, "avg_share": avg / wall, "fetch_share": fetch / wall}


class ParameterAveragingEfficiency:
    """asv: the ratios are the figures (``track_``), not an absolute time; one measurement per
    network (``setup_cache``) gives both."""

    timeout = 600
    timer = timeit.default_timer
    unit = "ratio"

    params = ["mlp", "cnn"]
    param_names = ["network"]

    def setup_cache(self):  # asv keys a cache by this function's place: each class defines its own
        return _measure_both("averaging")

    def track_efficiency_2_workers(self, results, kind):
        return results[kind]["efficiency"]

    def track_efficiency_over_cluster_bound_2_workers(self, results, kind):
        return results[kind]["efficiency_over_bound"]


class GradientSharingEfficiency(ParameterAveragingEfficiency):
    def setup_cache(self):
        return _measure_both("sharing")


def _measure_both(algorithm):
    return {kind: measure(kind, algorithm=algorithm) for kind in ParameterAveragingEfficiency.params}


if __name__ == "__main__":
    algorithms = [a for a in sys.argv[1:] if a in ("averaging", "sharing")] or ["averaging", "sharing"]
    kinds = [a for a in sys.argv[1:] if a in ("mlp", "cnn")] or ["mlp", "cnn"]
    updater = "adam" if "adam" in sys.argv[1:] else "sgd"
    for algorithm, kind in [(a, k) for a in algorithms for k in kinds]:
        r = measure(kind, algorithm=algorithm, updater=updater)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
