"""The XLA threshold encoder (ParallelWrapper's, for accelerators) against the workers' host encoder."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dlspark.algorithms.sharing._encoding import decode, threshold_encode
from dlspark.algorithms.sharing._xla import encode_on_device_jit, message_bytes, sparsity_of


@settings(max_examples=60, deadline=None)
@given(n=st.sampled_from([1, 2, 17, 100, 2049]), log_scale=st.floats(-6, 3), ratio=st.floats(0.05, 3.0), ties=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_the_xla_encoder_has_the_host_encoders_bits(n, log_scale, ratio, ties, seed):
    rng = np.random.default_rng(seed)
    scale = 10.0 ** log_scale
    r = (rng.standard_normal(n) * scale).astype(np.float32)
    t = np.float32(scale * ratio)
    if ties:  # exact multiples of the threshold: the rounding corner cases
        k = max(1, n // 3)
        r[:k] = t * rng.integers(-5, 6, k).astype(np.float32)
    enc = threshold_encode(r, t, min_count=2)
    moved, residual, count = (np.asarray(x) for x in encode_on_device_jit(jnp.asarray(r), t, min_count=2))
    assert np.array_equal(decode(enc.message).view(np.int32), moved.view(np.int32))
    assert np.array_equal(enc.residual.view(np.int32), residual.view(np.int32))
    assert int(count) == enc.count
    # decode(encode(r)) + residual == r, bit for bit, on the device as on the host
    assert np.array_equal((moved + residual).view(np.int32), r.view(np.int32))
    assert np.array_equal((decode(enc.message) + enc.residual).view(np.int32), r.view(np.int32))
    assert message_bytes(int(count), n) == enc.message.nbytes
    fmt = int(enc.message[0])
    assert sparsity_of(int(count), n) == (1 / 16 if fmt == 2 else enc.count / n if fmt == 1 else 0.0)
