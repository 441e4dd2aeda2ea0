"""What recording training statistics costs a step.

Measured, each figure as the median and range of several repeats:

1. one recorded event on the hot path (``Recorder.mark`` with and without figures) and
   the same call on the no-op recorder that runs hold when statistics are off;
2. events per step, counted in a real 2-worker job of each algorithm with
   ``collect_training_stats=True`` (every event of every worker, the scheduler's and
   the client's included, over the minibatches trained);
3. the ~10 ms step of ``_common.WideMLP`` (batch 64, one core), and what waiting for each
   step's end costs against waiting once per round (a recording averaging worker waits
   for every step so that each minibatch's time is its own).

The figure of merit is (1) x (2) over (3): the share of a ~10 ms step spent recording.

    python benchmarks/bench_stats.py            # prints the figures
    python benchmarks/bench_stats.py --no-job   # without the cluster jobs (2 uses a fixed count)
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def _pin():
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})


def _spread(xs):
    return f"{statistics.median(xs):.3g} [{min(xs):.3g}-{max(xs):.3g}]"


def event_cost(n=100_000, repeats=7):
    """Microseconds per ``mark`` (recording, recording with figures, and off)."""
    from dlspark.stats._recorder import NULL, Recorder

    out = {"mark": [], "mark+figures": [], "off": []}
    for _ in range(repeats):
        rec = Recorder()
        rec.begin_order(round=1)
        t0 = time.perf_counter()
        for _ in range(n):
            rec.mark("fit")
        out["mark"].append((time.perf_counter() - t0) / n * 1e6)
        rec = Recorder()
        rec.begin_order(round=1)
        t0 = time.perf_counter()
        for _ in range(n):
            rec.mark("encode", step=5, threshold=1e-3, sparsity=1e-3, bytes=400)
        out["mark+figures"].append((time.perf_counter() - t0) / n * 1e6)
        t0 = time.perf_counter()
        for _ in range(n):
            NULL.mark("fit")
        out["off"].append((time.perf_counter() - t0) / n * 1e6)
    return out


_BASE = {"phase", "start", "duration", "worker", "lane", "round", "job"}


def events_per_step():
    """``{algorithm: (plain events, events with figures)}`` recorded per minibatch trained,
    in a 2-worker job of each algorithm."""
    import optax
    from distributed import Client

    import dlspark
    from dlspark.cluster import local_cluster

    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))

    ds = dlspark.datasets.digits()[0]
    model = dlspark.Model.from_flax(MLP(), ds.features[:1])
    out = {}
    with local_cluster(2) as cluster, Client(cluster) as client:
        for master in (dlspark.ParameterAveraging(batch_size_per_worker=16, averaging_frequency=5,
                                                  collect_training_stats=True),
                       dlspark.GradientSharing(batch_size_per_worker=16, collect_training_stats=True)):
            net = dlspark.Network(model, loss="softmax_cross_entropy", updater=optax.adam(1e-3), seed=0)
            with dlspark.DistributedTrainer(client, net, master, progress=False) as tr:
                tr.fit(ds, epochs=2)
                s = tr.training_stats
                steps = sum(r["minibatches"] for r in s)
                figures = sum(1 for e in s.events if set(e) - _BASE)
                out[master.name] = ((len(s.events) - figures) / steps, figures / steps)
    return out


def step_time(repeats=7, steps=40):
    """``(ms per step, waiting-per-step overhead)`` of the ~10 ms WideMLP step, batch 64."""
    import jax

    from _common import make_data, make_network

    net = make_network("mlp")
    batch = jax.tree_util.tree_map(jax.numpy.asarray, make_data(64, "mlp").jit_batch())
    st = net.state
    for _ in range(5):
        out = net.steps.train_step(st, batch)
        st = out.state
    out.loss.block_until_ready()
    once, each = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = net.steps.train_step(st, batch)
            st = out.state
        out.loss.block_until_ready()
        once.append((time.perf_counter() - t0) / steps * 1e3)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = net.steps.train_step(st, batch)
            st = out.state
            out.loss.block_until_ready()
        each.append((time.perf_counter() - t0) / steps * 1e3)
    return once, [e / o - 1 for e, o in zip(each, once)]


def main():
    job = "--no-job" not in sys.argv
    # without the jobs: the per-step events the worker runs record (averaging: data_wait and
    # fit, the load on its own lane; sharing: eight main-lane phases, one push, one receive)
    per_step = events_per_step() if job else {"averaging (per-step events only)": (2, 1),
                                              "sharing (per-step events only)": (7, 4)}
    _pin()
    cost = event_cost()
    step_ms, wait_overhead = step_time()
    print(f"one event (us): recording {_spread(cost['mark'])}, with figures {_spread(cost['mark+figures'])}, "
          f"off {_spread(cost['off'])}")
    print(f"~10 ms step (ms): {_spread(step_ms)}; waiting for every step: {_spread([100 * x for x in wait_overhead])} %")
    plain, fig = statistics.median(cost["mark"]), statistics.median(cost["mark+figures"])
    for name, (n_plain, n_fig) in per_step.items():
        us = n_plain * plain + n_fig * fig
        share = [us / (ms * 1e3) * 100 for ms in step_ms]
        print(f"{name}: {n_plain:.2f} + {n_fig:.2f} (with figures) events per step = {us:.1f} us "
              f"-> {_spread(share)} % of the ~10 ms step")


if __name__ == "__main__":
    main()
