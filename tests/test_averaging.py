import jax.numpy as jnp
import numpy as np
import pytest

from dlspark.distributed._averaging import average_leaves, average_on_device


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_device_average_has_the_bits_of_the_host_reference(n):
    # Leaves of several dtypes; integer leaves (counts, RNG keys) keep the replica's own value.
    rng = np.random.default_rng(n)
    own = [rng.normal(size=(7, 3)).astype(np.float32), np.arange(4, dtype=np.int32),
           rng.normal(size=11).astype(jnp.bfloat16), np.float32(rng.normal())]
    contributions = [[x + k if x.dtype == np.int32 else rng.normal(size=np.shape(x)).astype(x.dtype) for x in own]
                     for k in range(n)]
    contributions[0] = [jnp.asarray(x) for x in contributions[0]]  # the replica's own leaves stay on the device
    host = average_leaves(own, contributions)
    device = average_on_device([jnp.asarray(x) for x in own], contributions)
    for h, d in zip(host, device):
        assert np.asarray(d).dtype == np.asarray(h).dtype
        np.testing.assert_array_equal(np.asarray(d), np.asarray(h))  # bit for bit, n = 3 and 5 included
    np.testing.assert_array_equal(np.asarray(device[1]), own[1])
    if n > 1:  # a mean, not one contribution
        assert not np.array_equal(np.asarray(device[0]), np.asarray(contributions[0][0]))


def test_device_average_of_nothing_is_the_replica_itself():
    own = [jnp.ones(3), jnp.arange(2)]
    assert average_on_device(own, []) == own
