"""Reading one minibatch file: ``dlspark.data.load_minibatch`` next to numpy's own reader.

A worker's loading thread reads every minibatch of an exported fit from its file, one file
a step; where a step is short (a GPU, a small network) that read bounds the steps' rate. The
figure is the ratio of two times measured here in the same process on the same local file:
``load_minibatch`` (read through fsspec, CRC checked, arrays copied out, the DataSet built)
over ``np.load(path)`` with every member read. Two sizes: 8 examples of 64 features (the
digits' shape), and 160 of 320 (the benchmarks' MLP minibatch). The median of seven
repeats of many reads each, with their range. Print them with ``python
benchmarks/bench_loading.py``.
"""

import os
import statistics
import tempfile
import timeit

import numpy as np

from dlspark.data import DataSet, load_minibatch, save_dataset

SIZES = {"digits_8x64": (8, 64), "mlp_160x320": (160, 320)}


def _np_load(path):
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def measure(name, repeat=7, number=500):
    n, features = SIZES[name]
    rng = np.random.default_rng(0)
    data = DataSet(rng.normal(size=(n, features)).astype(np.float32),
                   np.eye(10, dtype=np.float32)[rng.integers(0, 10, n)])
    with tempfile.TemporaryDirectory() as d:
        path = save_dataset(data, os.path.join(d, "minibatch.npz"))
        size = os.path.getsize(path)
        load_minibatch(path), _np_load(path)  # warm: imports, the file in the page cache
        ours, plain = [], []
        for _ in range(repeat):  # interleaved, so that drift reaches both alike
            ours.append(timeit.timeit(lambda: load_minibatch(path), number=number) / number)
            plain.append(timeit.timeit(lambda: _np_load(path), number=number) / number)
    ratios = [a / b for a, b in zip(ours, plain)]
    return {"size": name, "bytes": size, "load_minibatch_us": statistics.median(ours) * 1e6,
            "np_load_us": statistics.median(plain) * 1e6, "over_np_load": statistics.median(ratios),
            "over_np_load_min": min(ratios), "over_np_load_max": max(ratios)}


class TrackLoading:
    """asv: ``load_minibatch``'s time over ``np.load``'s for the same file (lower is better)."""

    params = list(SIZES)
    param_names = ["size"]
    unit = "ratio"
    timeout = 120

    def track_over_np_load(self, size):
        return measure(size, repeat=3, number=200)["over_np_load"]


if __name__ == "__main__":
    for name in SIZES:
        r = measure(name)
        print(f"{name}: load_minibatch {r['load_minibatch_us']:.0f} us, np.load {r['np_load_us']:.0f} us, "
              f"ratio {r['over_np_load']:.2f} ({r['over_np_load_min']:.2f}-{r['over_np_load_max']:.2f})")
