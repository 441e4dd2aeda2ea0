"""Threshold encoding throughput next to a memory copy of the same bytes.

The figure is the ratio: encoding elements/s over copy elements/s, both
measured here in the same process on the same vector. Two lengths: 4 M
elements (16 MB, which a large last-level cache holds, so the copy runs at
cache speed) and 64 M elements (256 MB, past any cache: the copy runs at
memory speed, as it does for a network of that many parameters). Print them
with ``python benchmarks/bench_encoding.py``.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from _common import best_of as _best  # noqa: E402

from dlspark.algorithms.sharing import _encoding
from dlspark.algorithms.sharing._encoding import decode, encode_scratch, threshold_encode

N = 4_000_000
LENGTHS = (N, 64_000_000)


def _vector(sparsity, n=N):
    rng = np.random.default_rng(0)
    r = rng.normal(0, 1, n).astype(np.float32)
    t = float(np.quantile(np.abs(r), 1 - sparsity))
    return r, t


def measure(sparsity, n=N):
    r, t = _vector(sparsity, n)
    dst = np.empty_like(r)
    copy = _best(lambda: np.copyto(dst, r))
    # The worker's hot path: the residual is updated in place, scratch buffers reused.
    # Each timed call starts from the same residual (restored outside the clock):
    # encoding one vector again and again would time ever emptier encodes.
    work, scratch = r.copy(), encode_scratch(n)
    enc = _best(lambda: threshold_encode(work, t, out=work, scratch=scratch), setup=lambda: np.copyto(work, r))
    # The same with numpy's scan, where the compiled one (dlspark[fast]) is installed.
    compiled, numpy_enc = _encoding._SCAN, enc
    if compiled is not None:
        _encoding._SCAN = None
        try:
            numpy_enc = _best(lambda: threshold_encode(work, t, out=work, scratch=scratch),
                              setup=lambda: np.copyto(work, r))
        finally:
            _encoding._SCAN = compiled
    pure = _best(lambda: threshold_encode(r, t))
    msg = threshold_encode(r, t).message
    dec = _best(lambda: decode(msg))
    return {"sparsity": sparsity, "encode_Melem_s": n / enc / 1e6, "copy_Melem_s": n / copy / 1e6,
            "encode_over_copy": copy / enc, "numpy_scan_encode_over_copy": copy / numpy_enc,
            "compiled_scan": compiled is not None, "pure_encode_over_copy": copy / pure, "decode_over_copy": copy / dec, "format": int(msg[0])}


class Encoding:
    """asv: encoding and decoding speed as a fraction of memory-copy speed."""

    params = [[1e-4, 1e-3, 1e-2, 1e-1], list(LENGTHS)]
    param_names = ["sparsity", "length"]
    unit = "ratio"
    timeout = 300

    def track_encode_over_copy(self, sparsity, length):
        return measure(sparsity, length)["encode_over_copy"]

    def track_decode_over_copy(self, sparsity, length):
        return measure(sparsity, length)["decode_over_copy"]


if __name__ == "__main__":
    for n in LENGTHS:
        for s in Encoding.params[0]:
            r = measure(s, n)
            print(f"length={n} " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
