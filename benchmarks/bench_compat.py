"""The cost of DL4J's shape: ``fitPaths`` through dlspark.compat over the core's ``fit_paths``.

figure = (median seconds of ``SparkDl4jMultiLayer.fitPaths(rdd_of_paths)``) /
(median seconds of ``DistributedTrainer.fit_paths(paths)``), the same minibatch
files, the same 2-worker Dask LocalCluster, the same master settings, runs
alternating. The difference is what compat adds: one Spark job that collects the
RDD's path strings (once: the RDD is persisted, as one that every epoch reads is),
and the translation of the call; a fixed cost per call,
also printed in seconds (``compat_minus_core_s``), so the ratio depends on the
length of an epoch (here 512 minibatches of 32 for a ~10 ms step). Target: at most 1.1.
Print it with ``python benchmarks/bench_compat.py`` (needs pyspark and Java).
"""

import os
import shutil
import sys
import tempfile
import time
import timeit

sys.path.insert(0, os.path.dirname(__file__))

from _common import make_data, make_network  # noqa: E402

#: minibatch files of BATCH examples (an epoch of ~3 s of steps per worker here); REPEAT timed fits
#: of each kind, alternating
N_FILES, BATCH, FREQUENCY, REPEAT, KIND = 512, 32, 4, 7, "mlp"


def _median(xs):
    return sorted(xs)[len(xs) // 2]


def measure(n_files=N_FILES, batch=BATCH, repeat=REPEAT, kind=KIND, workers=2):
    from distributed import Client
    from pyspark import SparkConf, SparkContext

    import dlspark
    from dlspark.cluster import local_cluster
    from dlspark.compat import ParameterAveragingTrainingMaster, SparkDl4jMultiLayer, configure
    from dlspark.distributed._worker import DlsparkWorkerPlugin

    directory = tempfile.mkdtemp(prefix="dlspark-bench-compat-")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    conf = SparkConf().setMaster("local[2]").setAppName("bench-compat").set("spark.ui.enabled", "false")
    sc = SparkContext.getOrCreate(conf)
    sc.setLogLevel("ERROR")
    try:
        urls = dlspark.data.save_minibatches(make_data(n_files * batch, kind), url=directory, batch_size=batch)
        paths = sc.parallelize(urls, 4).cache()  # as a DL4J user keeps an RDD that every epoch reads
        with local_cluster(workers) as cluster, Client(cluster) as client:
            client.register_plugin(DlsparkWorkerPlugin(pin_cores=True, n_workers=workers, cores_per_worker=1))
            configure(client=client)
            tm = ParameterAveragingTrainingMaster.Builder(batch).batchSizePerWorker(batch) \
                .averagingFrequency(FREQUENCY).build()
            core = dlspark.DistributedTrainer(client, make_network(kind), tm.algorithm, progress=False)
            spark_net = SparkDl4jMultiLayer(sc, make_network(kind), tm)
            core.fit_paths(urls)  # warm-up: compile on every worker, start Spark's Python workers
            spark_net.fitPaths(paths)
            t_core, t_compat = [], []
            for i in range(repeat):
                for which in (("core", "compat") if i % 2 == 0 else ("compat", "core")):
                    t0 = time.perf_counter()
                    if which == "core":
                        core.fit_paths(urls)
                        t_core.append(time.perf_counter() - t0)
                    else:
                        spark_net.fitPaths(paths)
                        t_compat.append(time.perf_counter() - t0)
            configure(client=None)
    finally:
        sc.stop()
        shutil.rmtree(directory, ignore_errors=True)
    core_s, compat_s = _median(t_core), _median(t_compat)
    return {"core_fit_paths_s": core_s, "compat_fit_paths_s": compat_s, "overhead_ratio": compat_s / core_s,
            "compat_minus_core_s": compat_s - core_s}


class CompatFitPathsOverhead:
    """asv: the ratio is the figure."""

    timeout = 600
    timer = timeit.default_timer
    unit = "ratio"

    def track_fit_paths_over_core(self):
        return measure()["overhead_ratio"]


if __name__ == "__main__":
    print(" ".join(f"{k}={v:.3f}" for k, v in measure().items()))
