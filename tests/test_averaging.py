import jax.numpy as jnp
import numpy as np
import pytest

from dlspark.algorithms.averaging._numerics import average_leaves, average_on_device


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


@pytest.mark.parametrize("n", [1, 3, 4, 7])
def test_shares_put_together_have_the_bits_of_the_full_mean(n):
    # Each of n owners averages its share of the flat floating-point elements; the
    # shares put together are the mean, bit for bit, whatever the leaves' sizes.
    from dlspark.algorithms.averaging._numerics import (assemble, average_share, is_averaged, share_bounds, share_pieces,
                                                take_share)

    rng = np.random.default_rng(n)
    own = [rng.normal(size=(7, 3)).astype(np.float32), np.arange(4, dtype=np.int32), np.zeros((0, 5), np.float32),
           rng.normal(size=11).astype(jnp.bfloat16), np.float32(rng.normal()), rng.normal(size=(2, 2)).astype(np.float16)]
    contributions = [[x + k if x.dtype == np.int32 else rng.normal(size=np.shape(x)).astype(x.dtype) for x in own]
                     for k in range(n)]
    floats = [i for i, x in enumerate(own) if is_averaged(x)]
    sizes = [int(np.size(own[i])) for i in floats]
    pieces, values = [], []
    for k in range(n):
        mine = share_pieces(sizes, *share_bounds(sizes, n, k))
        pieces += mine
        values += average_share([take_share([c[i] for i in floats], mine) for c in contributions])
    got = assemble([own[i] for i in floats], pieces, values)
    want = average_leaves(own, contributions)
    for i, g in zip(floats, got):
        assert g.shape == np.shape(own[i]) and g.dtype == np.asarray(want[i]).dtype
        np.testing.assert_array_equal(g, np.asarray(want[i]))
