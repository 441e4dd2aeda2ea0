"""Per-step cost of a warm ``Network.fit`` against a bare ``jax.jit`` + optax loop.

The digits MLP (64-128-10) at 16 examples per minibatch, Adam: a step of a few
hundred microseconds, where whatever Python does per step shows. Both run in
this process, pinned to one core, every shape compiled before the clock; the
plain loop takes numpy minibatches as they come, as a user's loop would.
Each round times one epoch of each contender, in alternating order; the figure
is the median of the per-round ratios (``Network.fit`` time over plain time).

``Network.fit`` runs by default 16 minibatches of one shape per compiled call (a
rolled ``lax.scan``; ``steps_per_call``), which the plain loop, one call per
step as the field writes it, does not; the third figure, ``fit`` with
``steps_per_call=1``, is the per-step path's own cost against the same loop.

    python benchmarks/bench_fit_overhead.py          # prints the medians and spreads
"""

import os
import statistics
import sys
import time
import timeit

sys.path.insert(0, os.path.dirname(__file__))

BATCH = 16


def _setup():
    import flax.linen as nn
    import jax
    import optax

    import dlspark
    from _common import plain_optax_step

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.relu(nn.Dense(128)(x)))

    tr, _ = dlspark.datasets.digits()
    model, tx = MLP(), optax.adam(3e-3)
    x, y = tr.features, tr.labels

    step = plain_optax_step(model, tx)

    numpy_batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]
    plain = {"params": model.init(jax.random.PRNGKey(0), x[:1])}
    plain["opt"] = tx.init(plain["params"])

    def plain_epoch():
        p, o = plain["params"], plain["opt"]
        for xb, yb in numpy_batches:
            p, o, loss = step(p, o, xb, yb)
        jax.block_until_ready((p, o))
        plain["params"], plain["opt"] = p, o

    net = dlspark.Network(dlspark.Model.from_flax(MLP(), x[:1]), updater=tx, seed=0)
    ds_batches = tr.batches(BATCH)

    def fit_list():
        net.fit(ds_batches)
        jax.block_until_ready(net.state)

    def fit_dataset():
        net.fit(tr, batch_size=BATCH)
        jax.block_until_ready(net.state)

    def fit_per_step():
        net.fit(ds_batches, steps_per_call=1)
        jax.block_until_ready(net.state)

    for fn in (plain_epoch, fit_list, fit_dataset, fit_per_step):  # compile every shape, warm the caches
        fn()
        fn()
    return plain_epoch, fit_list, fit_dataset, fit_per_step


def measure(rounds=15):
    """Per-round ratios of ``Network.fit`` (a list of DataSets; one DataSet with ``batch_size``;
    the list with one call per step) over the plain loop, one epoch each."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    plain, fit_list, fit_dataset, fit_per_step = _setup()
    out = {"list": [], "dataset": [], "per_step": [], "plain_us_per_step": []}
    steps = None
    for r in range(rounds):
        timings = {}
        order = [("plain", plain), ("list", fit_list), ("dataset", fit_dataset), ("per_step", fit_per_step)]
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            fn()
            timings[name] = time.perf_counter() - t0
        for name in ("list", "dataset", "per_step"):
            out[name].append(timings[name] / timings["plain"])
        if steps is None:
            import dlspark
            steps = -(-len(dlspark.datasets.digits()[0]) // BATCH)
        out["plain_us_per_step"].append(1e6 * timings["plain"] / steps)
    return out


class NetworkFitOverhead:
    """asv: Network.fit's time per epoch over the plain loop's (a ratio, lower is better)."""

    timeout = 300
    timer = timeit.default_timer
    unit = "ratio"

    def setup_cache(self):
        return measure()

    def track_fit_list_over_plain(self, results):
        return statistics.median(results["list"])

    def track_fit_dataset_over_plain(self, results):
        return statistics.median(results["dataset"])

    def track_fit_one_call_per_step_over_plain(self, results):
        return statistics.median(results["per_step"])


if __name__ == "__main__":
    res = measure()
    for k in ("list", "dataset", "per_step"):
        v = sorted(res[k])
        print(f"Network.fit ({k}) / plain loop: median {statistics.median(v):.3f}, range {v[0]:.3f}-{v[-1]:.3f}")
    us = sorted(res["plain_us_per_step"])
    print(f"plain loop: median {statistics.median(us):.0f} us per step, range {us[0]:.0f}-{us[-1]:.0f}")
