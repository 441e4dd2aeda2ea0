"""A network built again from the same definition: its first fit with the step functions it
shares with the first network, over the same fit with step functions of its own.

A notebook cell run twice, a search that builds each trial's network afresh, a checkpoint
loaded into a new network, a worker's next job from another client-side network alike: each
builds a :class:`dlspark.Network` whose definition this process has met. Its first fit then
traced, lowered and compiled every step again. The figure is the ratio of two times measured
in the same process: the new network's first fit (one epoch of 1,024 examples, minibatch 32,
the benchmarks' MLP or CNN, Adam) when it shares the earlier network's steps, over the same
fit after :func:`dlspark.network.clear_shared_steps` (its own steps: what every rebuild cost
before). Both sides run the same steps on the same data; the earlier network has compiled
every shape. No persistent compilation cache is set (the default): a rebuild without shared
steps compiles again. Interleaved, median of five with the range. Print them with ``python
benchmarks/bench_rebuild.py``.
"""

import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))
from _common import make_data, make_network  # noqa: E402

from dlspark.network import clear_shared_steps  # noqa: E402

KINDS = ("mlp", "cnn")


def _first_fit(kind, data, shared):
    if not shared:
        clear_shared_steps()
    net = make_network(kind, updater="adam")
    start = time.perf_counter()
    net.fit(data, epochs=1, batch_size=32)
    jax.block_until_ready(net.state)
    return time.perf_counter() - start


def measure(kind, repeat=5):
    data = make_data(1024, kind)
    _first_fit(kind, data, shared=False)  # imports, data, the first network's compilations
    alike, own = [], []
    for _ in range(repeat):  # interleaved, so that drift reaches both alike
        own.append(_first_fit(kind, data, shared=False))
        make_network(kind, updater="adam").fit(data, epochs=1, batch_size=32)  # compiled for the next one
        alike.append(_first_fit(kind, data, shared=True))
    ratios = [a / b for a, b in zip(alike, own)]
    return {"network": kind, "shared_s": statistics.median(alike), "own_s": statistics.median(own),
            "over_own": statistics.median(ratios), "over_own_min": min(ratios), "over_own_max": max(ratios)}


class TrackRebuild:
    """asv: a rebuilt network's first fit with shared steps over with its own (lower is better)."""

    params = list(KINDS)
    param_names = ["network"]
    unit = "ratio"
    timeout = 600

    def track_over_own(self, network):
        return measure(network, repeat=3)["over_own"]


if __name__ == "__main__":
    for kind in KINDS:
        r = measure(kind)
        print(f"{kind}: shared {r['shared_s']:.3f} s, own {r['own_s']:.3f} s, ratio {r['over_own']:.3f} "
              f"({r['over_own_min']:.3f}-{r['over_own_max']:.3f})", flush=True)
