"""Accuracy at equal epochs: distributed training against a single process.

Three tasks, each small enough that one fit takes seconds on one core:

- ``image``: scikit-learn's 8x8 digits (real images), an MLP of 128 hidden units;
- ``tabular``: Gaussian clusters in 32 dimensions, 12 classes, 8,000 examples, noisy
  enough that the classes overlap;
- ``sequence``: variable-length sequences (5 to 20 steps of 4 features, zero-padded,
  with a features mask); the class is the largest of the four masked sums; an LSTM
  reads the sequence up to its length.

For every seed the single process and every distributed run start from the same
parameters and see the same minibatches of the same shuffled data (paired seeds), with
Adam and 16 examples per minibatch (per worker). Every fit runs on the embedded
``LocalCluster`` (one cluster per worker count, reused across seeds and tasks).
The figure per run is test accuracy after the same number of epochs; the summary is the
mean paired difference from the single process and its standard error, and for
gradient sharing the bytes it sent over the whole fit against dense fp32 messages.

A second reference, ``single-global``, is the single process at the global minibatch of
``n`` workers (``n`` x 16 examples a step, the same seeds and shuffles): n replicas that
average or sum their updates take fewer, less noisy steps than one process at 16, and
this row tells that effect of the batch from one of distribution. The rule is the parity
suite's (``bench_suite.py``), against the single process at 16: every task's mean paired
difference no worse than -1.0 point (``holds``), and their average over the tasks no worse
than -0.5 (the table's last rows); the last column is against the global minibatch.

Run ``python benchmarks/bench_parity.py --seeds 10 --workers 2 4`` (``--help`` for the
options; ``--runtime wrapper`` trains the distributed runs on a ParallelWrapper over CPU
devices of this process, the same job without the worker processes); every result is
appended to the JSON file (``--out``) as it comes, so a partial run still counts, and a run
given the same file skips what is in it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

BATCH = 16
#: the rule (points): every task's mean paired difference, and their average over the tasks
RULE_EVERY, RULE_MEAN = -1.0, -0.5

#: run name -> (algorithm, options): what the acceptance compares (defaults as shipped)
RUNS = {
    "averaging": ("averaging", {"averaging_frequency": 5}),
    "sharing": ("sharing", {}),
}


def _sgd(rate, momentum=None):
    """An outer updater factory: optax's SGD at ``rate``, Nesterov's with ``momentum`` if given."""
    def make():
        import optax

        return optax.sgd(rate, momentum=momentum, nesterov=momentum is not None)

    return make


#: more runs: averaging at long periods, with and without DiLoCo's outer optimizer
#: (``outer`` names an outer updater factory, made when the run starts). Those filed before
#: 2026-11-30 took the outer step after every round with each replica at one worker's rate;
#: run again, ParameterAveraging takes it after full rounds only, over updates at its
#: ``outer_update_scale`` (the square root of the workers by default)
OUTER_RUNS = {
    **{f"averaging-f{f}": ("averaging", {"averaging_frequency": f}) for f in (20, 50)},
    **{f"averaging-f{f}-nesterov": ("averaging", {"averaging_frequency": f, "outer": "nesterov"}) for f in (5, 20, 50)},
}
#: outer updaters by name: DiLoCo's Nesterov step, and the smaller steps bench_suite measures at 50
OUTERS = {"nesterov": _sgd(0.7, 0.9), "sgd-1": _sgd(1.0), "sgd-0.5": _sgd(0.5), "nesterov-0.1": _sgd(0.1, 0.9)}


# -- tasks ------------------------------------------------------------------------------------
def _mlp(hidden):
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(self.n_out)(nn.relu(nn.Dense(hidden)(x)))

        n_out: int = 10

    return MLP


def _lstm_classifier(hidden, n_out):
    import flax.linen as nn
    import jax.numpy as jnp

    class LSTMClassifier(nn.Module):
        @nn.compact
        def __call__(self, x, mask=None):
            lengths = (jnp.sum(mask, axis=1) if mask is not None else jnp.full(x.shape[0], x.shape[1])).astype(jnp.int32)
            carry, _ = nn.RNN(nn.OptimizedLSTMCell(hidden), return_carry=True)(x, seq_lengths=lengths)
            return nn.Dense(n_out)(carry[1])

    return LSTMClassifier()


def image_data():
    import dlspark

    return dlspark.datasets.digits()


def tabular_data():
    import dlspark

    ds = dlspark.datasets.synthetic_classification(10000, n_features=32, n_classes=12, seed=11, noise=4.0)
    return ds[:8000], ds[8000:]


def sequence_data(n=6000, t_max=20, n_features=4, seed=5):
    import dlspark

    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, t_max + 1, n)
    mask = (np.arange(t_max)[None, :] < lengths[:, None]).astype(np.float32)
    x = rng.normal(0.0, 1.0, (n, t_max, n_features)).astype(np.float32) * mask[:, :, None]
    y = x.sum(axis=1).argmax(axis=1)
    ds = dlspark.DataSet(x, np.eye(n_features, dtype=np.float32)[y], features_mask=mask)
    cut = n * 4 // 5
    return ds[:cut], ds[cut:]


@dataclass(frozen=True)
class Task:
    name: str
    data: object  # () -> (train, test)
    module: object  # () -> flax module
    epochs: int
    learning_rate: float


TASKS = {
    "image": Task("image", image_data, lambda: _mlp(128)(n_out=10), 30, 3e-3),
    "tabular": Task("tabular", tabular_data, lambda: _mlp(64)(n_out=12), 3, 3e-3),
    "sequence": Task("sequence", sequence_data, lambda: _lstm_classifier(32, 4), 15, 3e-3),
}


def make_network(task, train, seed):
    import optax

    import dlspark

    model = dlspark.Model.from_flax(task.module(), train[:1].features)
    return dlspark.Network(model, updater=optax.adam(task.learning_rate), seed=seed)


def shuffled(train, seed):
    return train[np.random.default_rng(1000 + seed).permutation(len(train))]


def accuracy(net, test):
    out = np.asarray(net.output(test.features, features_mask=test.features_mask))
    return float((out.argmax(-1) == np.asarray(test.labels).argmax(-1)).mean())


# -- fits ---------------------------------------------------------------------------------------
def single_fit(task, data, seed, batch=BATCH):
    """Test accuracy of a plain ``Network.fit`` on one process, ``batch`` examples a step."""
    train, test = data
    net = make_network(task, train, seed)
    net.fit(shuffled(train, seed), epochs=task.epochs, batch_size=batch)
    return {"accuracy": accuracy(net, test)}


def make_master(algorithm, options):
    import dlspark

    if algorithm in ("averaging", "localsgd"):
        options = dict(options)
        if "outer" in options:
            options["outer_updater"] = OUTERS[options.pop("outer")]()
        if algorithm == "localsgd":
            return dlspark.algorithms.LocalSGD(batch_size_per_worker=BATCH, training_approach="direct", **options)
        return dlspark.ParameterAveraging(batch_size_per_worker=BATCH, training_approach="direct", **options)
    options = dict(options)
    if "band" in options:  # (min_sparsity, max_sparsity) of the adaptive threshold
        low, high = options.pop("band")
        options["threshold_algorithm"] = dlspark.AdaptiveThreshold(min_sparsity=low, max_sparsity=high)
    if "halving_steps" in options:  # the adaptive threshold halves or doubles over this many steps
        options["threshold_algorithm"] = dlspark.AdaptiveThreshold(decay=0.5 ** (1 / options.pop("halving_steps")))
    return dlspark.GradientSharing(batch_size_per_worker=BATCH, training_approach="direct", **options)


def distributed_fit(client, task, data, seed, algorithm, options):
    """Test accuracy of a ``DistributedTrainer`` fit; for gradient sharing also the bytes sent
    over the whole fit and the dense fp32 bytes the same messages would have taken."""
    import dlspark

    train, test = data
    net = make_network(task, train, seed)
    with dlspark.DistributedTrainer(client, net, make_master(algorithm, options), progress=False) as trainer:
        trainer.fit(shuffled(train, seed), epochs=task.epochs)
        return {"accuracy": accuracy(trainer.network, test), **_sharing_bytes(algorithm, trainer)}


def _sharing_bytes(algorithm, fitted) -> dict:
    """For gradient sharing, the bytes a fitted trainer or wrapper sent over its fit and the dense
    fp32 bytes the same messages would have taken; nothing for other algorithms."""
    comm = getattr(fitted, "communication", None)
    if algorithm != "sharing" or not comm or not comm.get("dense_bytes"):
        return {}
    return {"bytes_sent": int(comm["bytes_sent"]), "dense_bytes": int(comm["dense_bytes"]),
            "dense_ratio": comm["dense_bytes"] / max(1, comm["bytes_sent"])}


def wrapper_fit(task, data, seed, algorithm, options, workers):
    """:func:`distributed_fit` on a :class:`~dlspark.ParallelWrapper` over ``workers`` CPU
    devices of this process: the same job as on a cluster of that many workers (the two
    runtimes give the same bits, tests/test_runtimes.py), without a process per worker."""
    import dlspark

    train, test = data
    net = make_network(task, train, seed)
    wrapper = dlspark.ParallelWrapper(net, make_master(algorithm, options), devices=workers, progress=False)
    wrapper.fit(shuffled(train, seed), epochs=task.epochs)
    return {"accuracy": accuracy(net, test), "runtime": "wrapper", **_sharing_bytes(algorithm, wrapper)}


@contextlib.contextmanager
def cluster_client(workers):
    """A client of an embedded LocalCluster of ``workers`` workers, both closed after (a close
    that fails is reported, not raised: on a loaded machine a nanny can be slow to stop, and the
    results are saved by then)."""
    from distributed import Client

    from dlspark.cluster import local_cluster

    cluster = local_cluster(workers, dashboard_address=None)
    client = Client(cluster)
    try:
        yield client
    finally:
        for close in (client.close, cluster.close):
            try:
                close()
            except Exception as e:  # noqa: BLE001
                print(f"closing the {workers}-worker cluster: {e!r}", file=sys.stderr)


@contextlib.contextmanager
def _fitter(runtime, workers):
    """``fit(task, data, seed, algorithm, options)`` of a distributed run on ``runtime`` at
    ``workers``: a LocalCluster's (started here, closed after) or a ParallelWrapper's."""
    if runtime == "wrapper":
        yield lambda *job: wrapper_fit(*job, workers)
        return
    with cluster_client(workers) as client:
        yield lambda *job: distributed_fit(client, *job)


# -- summary ------------------------------------------------------------------------------------
def paired(results, task, run, workers, against=("single", 1)):
    """``(mean difference, standard error, n)`` of a run's accuracy minus a reference run's
    (``(run, workers)``: by default the single process at 16 examples a step), paired by seed."""
    single = {r["seed"]: r["accuracy"] for r in results
              if r["task"] == task and (r["run"], r["workers"]) == tuple(against)}
    diffs = [r["accuracy"] - single[r["seed"]] for r in results
             if r["task"] == task and r["run"] == run and r["workers"] == workers and r["seed"] in single]
    if not diffs:
        return None
    d = np.asarray(diffs)
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    return float(d.mean()), se, len(d)


#: the summary's columns
COLUMNS = ["task", "run", "workers", "seeds", "accuracy (mean ± sd)", "diff from single (mean ± se)", "holds",
           "dense/sent", "diff from single at the global batch (mean ± se)"]


def summary_rows(results) -> list:
    """The summary's rows (see :data:`COLUMNS`): per task the single process's mean ± sd, and per
    run and worker count the mean paired difference ± its standard error (and the bytes ratio
    for sharing), from the single process and, in the last column, from the single process at
    the run's global minibatch (``single-global``, whose own rows show their difference from the
    single process); then per run and worker count the rule over the tasks."""
    out = []
    means: dict = {}  # (run, workers) -> the tasks' mean differences (points)
    for task in TASKS:
        rows = [r for r in results if r["task"] == task]
        keys = sorted({(r["run"], r["workers"]) for r in rows},
                      key=lambda k: (k[0] != "single", k[0] != "single-global", k[0], k[1]))
        for run, w in keys:
            acc = np.array([r["accuracy"] for r in rows if r["run"] == run and r["workers"] == w])
            sd = acc.std(ddof=1) if len(acc) > 1 else float("nan")
            cell = f"{acc.mean():.4f} ± {sd:.4f}"
            if run == "single":
                out.append([task, "single", 1, len(acc), cell, "", "", "", ""])
                continue
            p = paired(results, task, run, w)
            ratio = [r["dense_ratio"] for r in rows if r["run"] == run and r["workers"] == w and "dense_ratio" in r]
            ok = ""
            if p is not None and run != "single-global":
                means.setdefault((run, w), []).append(100 * p[0])
                ok = "yes" if 100 * p[0] >= RULE_EVERY else "no"
            diff = "" if p is None else f"{100 * p[0]:+.2f} ± {100 * p[1]:.2f} pts"
            g = None if run == "single-global" else paired(results, task, run, w, against=("single-global", w))
            name = f"single at {BATCH * w} a step" if run == "single-global" else run
            out.append([task, name, w, len(acc), cell, diff, ok, "" if not ratio else f"{min(ratio):.0f}x (min)",
                        "" if g is None else f"{100 * g[0]:+.2f} ± {100 * g[1]:.2f} pts"])
    for (run, w), m in sorted(means.items()):
        holds = "yes" if min(m) >= RULE_EVERY and float(np.mean(m)) >= RULE_MEAN else "no"
        out.append([f"all {len(m)} tasks", run, w, "", "", f"worst {min(m):+.2f}, average {np.mean(m):+.2f} pts",
                    holds, "", ""])
    return out


def summary_table(results) -> str:
    """:func:`summary_rows` as a markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in summary_rows(results)]
    return "\n".join(lines)


# -- the run ------------------------------------------------------------------------------------
def _load(path):
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return []


def _save(path, results):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)  # atomic: a run stopped mid-write leaves the last complete file


def run_grid(tasks, seeds, workers, runs, out, extra_runs=None, runtime="cluster"):
    """Run every missing (task, run, workers, seed) and append each result to ``out`` as it
    comes. ``extra_runs`` maps more run names to ``(algorithm, options)``; ``runtime``:
    the distributed runs on the embedded LocalCluster or on a ParallelWrapper."""
    if runtime not in ("cluster", "wrapper"):
        raise ValueError(f"runtime must be 'cluster' or 'wrapper', got {runtime!r}")
    specs = {**RUNS, **OUTER_RUNS, **(extra_runs or {})}
    results = _load(out)
    for r in results:  # results at another budget would be paired with these: refuse
        if r["task"] in tasks and r.get("epochs", TASKS[r["task"]].epochs) != TASKS[r["task"]].epochs:
            raise SystemExit(f"{out} holds {r['task']} results at {r['epochs']} epochs, and this run trains "
                             f"{TASKS[r['task']].epochs}: give another --out, or --epochs {r['task']}={r['epochs']}")
    done = {(r["task"], r["run"], r["workers"], r["seed"]) for r in results}
    data = {t: TASKS[t].data() for t in tasks}

    def record(task, run, w, seed, fn):
        if (task, run, w, seed) in done:
            return
        t0 = time.perf_counter()
        r = {"task": task, "run": run, "workers": w, "seed": seed, "epochs": TASKS[task].epochs, **fn(),
             "seconds": time.perf_counter() - t0}
        results.append(r)
        done.add((task, run, w, seed))
        _save(out, results)
        print(json.dumps(r), flush=True)

    for seed in range(seeds):
        for t in tasks:
            record(t, "single", 1, seed, lambda: single_fit(TASKS[t], data[t], seed))
            for w in workers:  # the second reference: one process at the workers' global minibatch
                record(t, "single-global", w, seed, lambda: single_fit(TASKS[t], data[t], seed, BATCH * w))
    for w in workers:
        with _fitter(runtime, w) as fit:
            for seed in range(seeds):
                for t in tasks:
                    for run in runs:
                        algorithm, options = specs[run]
                        record(t, run, w, seed, lambda: fit(TASKS[t], data[t], seed, algorithm, options))
    return results


# -- asv ----------------------------------------------------------------------------------------
class TrackParity:
    """asv: accuracy minus the single process's (points, mean over paired seeds) and, for
    gradient sharing, dense fp32 bytes over bytes sent, on two workers. Three seeds keep
    the suite to minutes; the script's acceptance runs use ten and four workers too."""

    params = (list(TASKS), list(RUNS))
    param_names = ["task", "run"]
    timeout = 3600
    seeds, workers = 3, 2

    def setup_cache(self):
        import tempfile

        out = os.path.join(tempfile.mkdtemp(), "parity.json")
        return run_grid(list(TASKS), self.seeds, [self.workers], list(RUNS), out)

    def track_difference_points(self, results, task, run):
        return 100 * paired(results, task, run, self.workers)[0]

    track_difference_points.unit = "points"

    def track_dense_over_sent(self, results, task, run):
        if run != "sharing":
            raise NotImplementedError  # asv: skipped (averaging sends dense parameters)
        ratios = [r["dense_ratio"] for r in results if r["task"] == task and r["run"] == run and "dense_ratio" in r]
        return min(ratios) if ratios else float("nan")

    track_dense_over_sent.unit = "ratio"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--workers", nargs="+", type=int, default=[2, 4])
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS) + list(OUTER_RUNS),
                   help="runs beside the single process (default: %(default)s)")
    p.add_argument("--epochs", nargs="+", default=[], metavar="TASK=N",
                   help="another epoch budget for a task, e.g. tabular=3 (write to another --out)")
    p.add_argument("--out", default="parity.json")
    p.add_argument("--runtime", choices=["cluster", "wrapper"], default="cluster",
                   help="the distributed runs on the embedded LocalCluster (default) or on a ParallelWrapper "
                        "over as many CPU devices of this process")
    p.add_argument("--table", action="store_true", help="only print the table of the results in --out")
    a = p.parse_args(argv)
    for item in a.epochs:
        task, _, n = item.partition("=")
        if task not in TASKS or not n.isdigit() or int(n) < 1:
            p.error(f"--epochs takes TASK=N with TASK one of {sorted(TASKS)} and N a positive integer, got {item!r}")
        TASKS[task] = replace(TASKS[task], epochs=int(n))
    if not a.table:
        if a.runtime == "wrapper":  # before JAX starts its CPU backend
            import jax

            jax.config.update("jax_num_cpu_devices", max(a.workers))
        run_grid(a.tasks, a.seeds, a.workers, a.runs, a.out, runtime=a.runtime)
    print(summary_table(_load(a.out)))


if __name__ == "__main__":
    sys.exit(main())
