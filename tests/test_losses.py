import jax.numpy as jnp
import numpy as np
import pytest

from dlspark.losses import LOSSES, _SPECS, get_loss, reduce_loss

RNG = np.random.default_rng(0)


def _labels_for(name, shape):
    if name in ("softmax_cross_entropy", "negative_log_likelihood", "kl_divergence"):
        return np.eye(shape[-1], dtype=np.float32)[RNG.integers(0, shape[-1], shape[:-1])]
    if name in ("binary_cross_entropy",):
        return RNG.integers(0, 2, shape).astype(np.float32)
    if name in ("hinge", "squared_hinge"):
        return RNG.choice([-1.0, 1.0], shape).astype(np.float32)
    return RNG.normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("name", sorted(_SPECS))
def test_every_loss_is_finite_per_element_and_respects_masks(name):
    loss = get_loss(name)
    out = RNG.normal(size=(4, 5, 3)).astype(np.float32)
    lab = _labels_for(name, out.shape)
    per = np.asarray(loss.fn(jnp.asarray(out), jnp.asarray(lab)))
    assert per.shape == (4, 5)
    assert np.isfinite(per).all()
    mask = np.zeros((4, 5), np.float32)
    mask[:2, :3] = 1
    mean, weight = reduce_loss(per, mask)
    assert float(weight) == 6
    np.testing.assert_allclose(float(mean), per[:2, :3].mean(), rtol=1e-6)
    # A per-example mask on a sequence loss masks whole rows.
    mean, weight = reduce_loss(per, np.array([1, 0, 0, 1], np.float32))
    np.testing.assert_allclose(float(mean), per[[0, 3]].mean(), rtol=1e-6)
    assert float(weight) == 10


def test_softmax_cross_entropy_matches_numpy_and_integer_labels():
    out = RNG.normal(size=(6, 4)).astype(np.float32)
    ids = RNG.integers(0, 4, 6)
    onehot = np.eye(4, dtype=np.float32)[ids]
    logp = out - np.log(np.exp(out).sum(-1, keepdims=True))
    expected = -logp[np.arange(6), ids]
    f = get_loss("MCXENT").fn
    np.testing.assert_allclose(np.asarray(f(out, onehot)), expected, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(f(out, ids.astype(np.int32))), expected, rtol=1e-5)


def test_regression_losses_against_numpy():
    out = RNG.normal(size=(5, 3)).astype(np.float32)
    lab = RNG.normal(size=(5, 3)).astype(np.float32)
    np.testing.assert_allclose(get_loss("mse").fn(out, lab), ((out - lab) ** 2).mean(-1), rtol=1e-5)
    np.testing.assert_allclose(get_loss("l2").fn(out, lab), ((out - lab) ** 2).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(get_loss("mae").fn(out, lab), np.abs(out - lab).mean(-1), rtol=1e-5)
    np.testing.assert_allclose(get_loss("l1").fn(out, lab), np.abs(out - lab).sum(-1), rtol=1e-5)
    cos = (out * lab).sum(-1) / np.linalg.norm(out, axis=-1) / np.linalg.norm(lab, axis=-1)
    np.testing.assert_allclose(get_loss("cosine_proximity").fn(out, lab), -cos, rtol=1e-5)


def test_hinge_maps_zero_labels_to_minus_one():
    out = np.array([[0.5, -2.0]], np.float32)
    a = get_loss("hinge").fn(out, np.array([[1.0, 0.0]], np.float32))
    b = get_loss("hinge").fn(out, np.array([[1.0, -1.0]], np.float32))
    np.testing.assert_allclose(a, b)
    np.testing.assert_allclose(a, [0.5 + 0.0])


def test_unknown_loss_lists_the_known_ones():
    with pytest.raises(ValueError, match="known losses: .*softmax_cross_entropy"):
        get_loss("softmax_xent_typo")
    with pytest.raises(TypeError, match="loss must be a name"):
        get_loss(3)
    assert set(LOSSES) >= {"mcxent", "xent", "mse", "mae", "l1", "nll", "hinge", "cosine_proximity", "kl_divergence"}


def test_bad_mask_shape_is_named():
    with pytest.raises(ValueError, match=r"label mask of shape \(3,\)"):
        reduce_loss(np.zeros((4, 5)), np.ones(3))
