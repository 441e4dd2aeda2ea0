"""What a fit pays to name states and data by content, next to a memory copy of the same bytes.

Every fit digests the whole train state several times: the client at its start (to send each
worker only what it does not hold) and at its end (the state a fit combined from the
replicas), each worker when it keeps its trained state (``dlspark.distributed._kept``); and
the client names in-memory training data by a Dask token of its arrays, so that a fit of the
same data trains from the files already exported. Each is timed here against ``np.copyto``
of the same arrays (best of seven, one process): a figure of 1 costs what touching the bytes
once costs. BLAKE2b, the digest before XXH3, is printed beside it. Two sizes: an Adam state
of the network benchmarks' 1.03 M-parameter MLP (its parameters and two moments, 12 MB, which
a large last-level cache holds) and of 25 M parameters (300 MB, past any cache).

    python benchmarks/bench_kept.py
"""

import hashlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from _common import best_of as _best  # noqa: E402

from dlspark.distributed._kept import digests

PARAMETERS = (1_030_000, 25_000_000)


def _state(n):
    """An Adam state's float arrays for ``n`` parameters: the parameters and two moments, in
    four leaves each (the layers' kernels and biases stand in)."""
    rng = np.random.default_rng(0)
    sizes = [n // 2, n // 4, n // 8, n - n // 2 - n // 4 - n // 8]
    return [rng.standard_normal(s, dtype=np.float32) for _ in range(3) for s in sizes]


def _blake2b(arrays):
    return [hashlib.blake2b(a.data.cast("B"), digest_size=16).digest() for a in arrays]


def measure(n):
    from dask.base import tokenize

    arrays = _state(n)
    out = [np.empty_like(a) for a in arrays]

    def copy():
        for a, o in zip(arrays, out):
            np.copyto(o, a)

    c = _best(copy)
    return {"parameters": n, "bytes": sum(a.nbytes for a in arrays), "copy_s": c,
            "digests_over_copy": _best(lambda: digests(arrays)) / c,
            "blake2b_over_copy": _best(lambda: _blake2b(arrays)) / c,
            "dask_token_over_copy": _best(lambda: tokenize(*arrays)) / c}


class KeptDigests:
    """asv: a state's digests and a Dask token of arrays, each over a copy of the same bytes."""

    params = [list(PARAMETERS)]
    param_names = ["parameters"]

    def setup(self, n):
        self.result = measure(n)

    def track_digests_over_copy(self, n):
        return self.result["digests_over_copy"]

    def track_dask_token_over_copy(self, n):
        return self.result["dask_token_over_copy"]


if __name__ == "__main__":
    for n in PARAMETERS:
        r = measure(n)
        print(f"{n / 1e6:5.2f} M parameters ({r['bytes'] / 2**20:.0f} MiB, copy {r['copy_s'] * 1e3:.1f} ms): "
              f"digests {r['digests_over_copy']:.2f}x the copy (BLAKE2b {r['blake2b_over_copy']:.2f}x), "
              f"Dask's token {r['dask_token_over_copy']:.2f}x")
