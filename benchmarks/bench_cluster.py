"""Cluster-side figures that are not speed: bytes on the wire and worker memory.

``track_`` benchmarks report ratios and sizes measured on a 2-worker LocalCluster.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _common import make_data, make_master, make_network  # noqa: E402


def _fit(algorithm, kind="mlp", minibatches=80, batch=32):
    from distributed import Client

    import dlspark
    from dlspark.cluster import local_cluster

    data = make_data(minibatches * batch, kind)
    with local_cluster(2) as cluster, Client(cluster) as client:
        net = make_network(kind)
        master = make_master(algorithm, batch, threshold_algorithm=dlspark.AdaptiveThreshold(initial=1e-3))
        trainer = dlspark.DistributedTrainer(client, net, master, progress=False)
        trainer.fit(data, epochs=2)
        stats = trainer.last_fit_stats
        steps = sum(s["minibatches"] for s in stats)
        sent = sum(s.get("bytes_sent", s.get("bytes_received", 0)) for s in stats)
        import resource

        rss = client.run(lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        trainer.close()
    dense = 4 * net.num_params  # one dense fp32 update to one peer
    return {"bytes_per_step_per_worker": sent / steps, "dense_bytes": dense,
            "ratio_to_dense": (sent / steps) / dense, "worker_peak_rss_mb": max(rss.values()) / 1024}


class WireAndMemory:
    params = ["averaging", "sharing"]
    param_names = ["algorithm"]
    timeout = 300

    def setup_cache(self):
        return {a: _fit(a) for a in self.params}

    def track_bytes_per_step_over_dense(self, cache, algorithm):
        return cache[algorithm]["ratio_to_dense"]

    track_bytes_per_step_over_dense.unit = "ratio"

    def track_worker_peak_rss_mb(self, cache, algorithm):
        return cache[algorithm]["worker_peak_rss_mb"]

    track_worker_peak_rss_mb.unit = "MB"


if __name__ == "__main__":
    for a in ("averaging", "sharing"):
        print(a, {k: round(v, 4) for k, v in _fit(a).items()})
