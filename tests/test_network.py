import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    MLP,
    BNNet,
    FiniteOutputs,
    SmallConv,
    accuracy,
    tree_equal,
    under_xla_defaults,
)

import dlspark
from dlspark import DataSet, Model, MultiDataSet, Network
from dlspark.errors import NonFiniteLossError


def test_flax_mlp_reaches_95_percent_on_digits(make_net, digits):
    tr, te = digits
    net = make_net(MLP(hidden=64, dropout=0.1))
    net.fit(tr, epochs=12, batch_size=32)
    assert net.epoch == 12 and net.iteration == 12 * int(np.ceil(len(tr) / 32))
    assert accuracy(net, te) >= 0.95
    assert net.score(te) < 0.3
    assert len(net.score_history) == net.iteration


def test_dataset_and_list_of_minibatches_train_identically(make_net, digits):
    tr, _ = digits
    a, b = make_net(), make_net()
    a.fit(tr, epochs=2, batch_size=50)
    b.fit(tr.batches(50), epochs=2)
    assert tree_equal(a.state, b.state)


def test_files_train_like_memory(make_net, digits, tmp_path):
    tr, _ = digits
    urls = dlspark.data.save_minibatches(tr, url=str(tmp_path), batch_size=64)
    a, b = make_net(), make_net()
    a.fit(tr, batch_size=64)
    b.fit(str(tmp_path) + "/*.npz")
    assert tree_equal(a.state.params, b.state.params)
    assert len(urls) == a.iteration


def test_shuffle_is_seeded_by_epoch(make_net, digits):
    tr, _ = digits
    a, b, c = make_net(), make_net(), make_net()
    a.fit(tr, epochs=2, batch_size=100, shuffle=True)
    b.fit(tr, epochs=2, batch_size=100, shuffle=True)
    c.fit(tr, epochs=2, batch_size=100)
    assert tree_equal(a.state, b.state)
    assert not tree_equal(a.state.params, c.state.params)


def test_batch_norm_statistics_are_carried_through_training(make_net, digits):
    tr, te = digits
    net = make_net(BNNet())
    before = jax.tree_util.tree_map(np.asarray, net.state.model_state)
    net.fit(tr, epochs=3, batch_size=64)
    after = net.state.model_state
    assert set(after) == {"batch_stats"}
    assert not tree_equal(before, after)
    # Inference uses the running averages: output does not depend on batch composition.
    full = net.output(te.features)
    one = net.output(te.features[:1])
    np.testing.assert_allclose(full[:1], one, rtol=1e-5, atol=1e-5)
    assert accuracy(net, te) > 0.9


class TwoInTwoOut(nn.Module):
    @nn.compact
    def __call__(self, xs):
        a, b = xs
        h = nn.relu(nn.Dense(32)(jnp.concatenate([a, b], -1)))
        return nn.Dense(10)(h), nn.Dense(1)(h)


def test_multi_input_multi_output_graph_trains(digits):
    tr, _ = digits
    x = tr.features
    y_reg = x.sum(1, keepdims=True) / 64
    mds = MultiDataSet([x[:, :32], x[:, 32:]], [tr.labels, y_reg])
    model = Model.from_flax(TwoInTwoOut(), (x[:1, :32], x[:1, 32:]))
    net = Network(model, loss=("mcxent", "mse"), updater=optax.adam(1e-2))
    s0 = net.score(mds)
    net.fit(mds, epochs=3, batch_size=64)
    assert net.score(mds) < 0.5 * s0
    cls, reg = net.output((x[:5, :32], x[:5, 32:]))
    assert cls.shape == (5, 10) and reg.shape == (5, 1)
    with pytest.raises(ValueError, match="got 3 losses for 2 outputs"):
        Network(model, loss=("mcxent", "mse", "mse")).fit(mds)


def test_plain_function_model_and_custom_loss():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)) + 0.1

    def init(key, xb):
        return {"w": jax.random.normal(key, (xb.shape[-1], 1)) * 0.01, "b": jnp.zeros((1,))}

    def apply(v, xb, train, key):
        return xb @ v["w"] + v["b"]

    def my_loss(out, lab):
        return jnp.abs(out - lab)[..., 0]

    net = Network(Model(init, apply, x[:1]), loss=my_loss, updater=optax.sgd(0.05))
    net.fit((x, y), epochs=60, batch_size=32)
    np.testing.assert_allclose(np.asarray(net.params["w"])[:, 0], [1.0, -2.0, 0.5, 3.0], atol=0.1)


def test_label_masks_for_sequences():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5, 3)).astype(np.float32)
    y = np.eye(4, dtype=np.float32)[rng.integers(0, 4, (8, 5))]
    mask = np.ones((8, 5), np.float32)
    mask[:, 3:] = 0

    def init(key, xb):
        return {"w": jax.random.normal(key, (3, 4))}

    def apply(v, xb, train, key):
        return xb @ v["w"]

    net = Network(Model(init, apply, x[:1]), loss="mcxent", updater=optax.sgd(0.1))
    y_garbage = y.copy()
    y_garbage[:, 3:] = np.eye(4, dtype=np.float32)[0]
    masked = net.score(DataSet(x, y, labels_mask=mask))
    assert masked == pytest.approx(net.score(DataSet(x, y_garbage, labels_mask=mask)), rel=1e-6)
    assert masked == pytest.approx(net.score(DataSet(x[:, :3], y[:, :3])), rel=1e-6)
    per = net.score_examples(DataSet(x, y, labels_mask=mask))
    assert per.shape == (8,)
    with pytest.raises(ValueError, match="label mask of shape"):
        net.score(DataSet(x, y, labels_mask=np.ones((8, 4))))


def test_bad_labels_and_features_raise_clear_errors(make_net, digits):
    tr, _ = digits
    net = make_net()
    with pytest.raises(ValueError, match=r"one-hot labels of the outputs' shape \(\d+, 10\) or integer"):
        net.fit(DataSet(tr.features, tr.labels[:, :5]))
    with pytest.raises(ValueError, match="different numbers of examples"):
        net.fit((tr.features, tr.labels[:-1]))
    with pytest.raises(ValueError, match="cannot take features of shape"):
        net.fit(DataSet(tr.features[:, :10], tr.labels))
    with pytest.raises(ValueError, match="epochs must be a positive integer"):
        net.fit(tr, epochs=0)
    with pytest.raises(TypeError, match="model must be a dlspark.Model"):
        Network(MLP())
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        make_net(on_nonfinite="ignore")
    # integer labels are fine for softmax cross-entropy
    net.fit(DataSet(tr.features, tr.labels.argmax(1).astype(np.int32)))


def test_class_ids_outside_the_outputs_are_refused_on_every_minibatch(make_net, digits):
    # Out of range, a class id indexes past the outputs: a NaN loss (and advice about the
    # learning rate) above, silently the last class below 0. Checked by value on each
    # minibatch, not once per shape; the network keeps its parameters.
    tr, _ = digits
    net = make_net()
    ids = tr.labels.argmax(1).astype(np.int32)
    before = jax.tree_util.tree_map(np.asarray, net.state.params)
    with pytest.raises(ValueError, match=r"class ids \[10\] outside \[0, 10\).*from 0 to 9"):
        net.fit(DataSet(tr.features[:64], ids[:64] + 1), batch_size=32)
    bad = ids[:64].copy()
    bad[40] = -1  # in the second minibatch, whose shape the first one checked
    with pytest.raises(ValueError, match=r"class ids \[-1\] outside"):
        net.fit(DataSet(tr.features[:64], bad), batch_size=32, steps_per_call=1)
    assert net.iteration == 1  # the first minibatch trained, the second was refused
    net2 = make_net()
    with pytest.raises(ValueError, match=r"class ids \[10\] outside"):
        net2.fit_minibatch(DataSet(tr.features[:8], np.full(8, 10, np.int32)))
    assert tree_equal(before, jax.tree_util.tree_map(np.asarray, net2.state.params))
    from dlspark.evaluation import Evaluation

    with pytest.raises(ValueError, match=r"class ids \[10\] outside \[0, 10\)"):
        Evaluation().update(np.full(8, 10), np.ones((8, 10)) / 10)


def test_empty_and_unlabelled_data_and_bad_batch_sizes_are_refused_by_name(make_net, digits):
    tr, _ = digits
    net = make_net()
    with pytest.raises(ValueError, match="holds no examples"):
        net.fit(tr[:0])
    with pytest.raises(ValueError, match="holds no examples"):
        net.fit([])
    with pytest.raises(ValueError, match="holds no examples"):
        net.fit_minibatch(tr[:0])
    assert (net.iteration, net.epoch) == (0, 0)
    with pytest.raises(ValueError, match="has no labels"):
        net.fit(DataSet(tr.features[:32], None))
    with pytest.raises(TypeError, match=r"fit got one array \(shape \(32, 64\)\): pass features and labels"):
        net.fit(tr.features[:32], epochs=1)
    with pytest.raises(ValueError, match="shuffle=True needs minibatches it can reorder"):
        net.fit(iter(tr[:64].batches(32)), shuffle=True)
    assert net.output(tr.features[:0]).shape == (0, 10)
    assert net.score_examples(tr[:0]).shape == (0,)
    out = net.output(tr.features[:40], batch_size=16)
    assert out.shape == (40, 10)
    for bad in (-2, 0, 2.5, True):
        with pytest.raises(ValueError, match="batch_size must be a positive integer or None"):
            net.output(tr.features[:40], batch_size=bad)
    with pytest.raises(ValueError, match=r"cannot take features of shape \(4, 10\)"):
        net.output(tr.features[:4, :10])


def test_nonfinite_loss_raises_naming_the_iteration_and_keeps_params(make_net, digits):
    tr, _ = digits
    bad = tr.features[:64].copy()
    bad[3, 5] = np.nan
    batches = tr[:128].batches(64) + [DataSet(bad, tr.labels[:64])]
    net = make_net()
    with pytest.raises(NonFiniteLossError, match="iteration 2") as info:
        net.fit(batches)
    assert info.value.iteration == 2 and net.iteration == 2
    assert all(np.isfinite(np.asarray(p)).all() for p in jax.tree_util.tree_leaves(net.params))
    skipper = make_net(on_nonfinite="skip")
    skipper.fit(batches + tr[128:192].batches(64))
    assert skipper.iteration == 3  # the NaN minibatch was not applied
    assert all(np.isfinite(np.asarray(p)).all() for p in jax.tree_util.tree_leaves(skipper.params))


def test_a_reloaded_module_s_model_gets_steps_of_its_own(digits, tmp_path, monkeypatch):
    # a class pickles by its module and name: after importlib.reload (or IPython's autoreload)
    # the same name holds new code, which a network built from it must run
    import importlib
    import sys

    code = ("import flax.linen as nn\n\n\nclass Net(nn.Module):\n"
            "    @nn.compact\n    def __call__(self, x):\n        return {}\n")
    (tmp_path / "edited_net.py").write_text(code.format("nn.Dense(10)(x)"))
    monkeypatch.syspath_prepend(str(tmp_path))
    import edited_net

    x = digits[0].features[:4]

    def build():
        return Network(Model.from_flax(edited_net.Net(), x[:1]), updater=optax.sgd(0.1))

    before = build()
    assert build().steps is before.steps  # the same class: shared
    (tmp_path / "edited_net.py").write_text(code.format("nn.Dense(10)(x) * 0.0"))
    importlib.reload(edited_net)
    try:
        after = build()
        assert after.steps is not before.steps
        assert not np.any(np.asarray(after.output(x))) and np.any(np.asarray(before.output(x)))
    finally:
        sys.modules.pop("edited_net", None)


@pytest.fixture
def fresh_steps():
    """For the tests that count compiled programs: no network built alike earlier in this
    process (whose step functions a new network shares) has compiled any yet."""
    dlspark.network.clear_shared_steps()


def test_networks_built_alike_share_their_step_functions_and_nothing_else(make_net, digits):
    import threading

    tr, _ = digits
    first, second = make_net(), make_net()  # two flax modules and two updaters, built alike
    assert second.steps is first.steps
    first.fit(tr[:640], batch_size=64)
    compiled = {name: getattr(first.steps, name)._cache_size() for name in first.steps._fields}
    second.fit(tr[:640], batch_size=64)
    # nothing traced or compiled again, and each network trained its own state: same seed, same bits
    assert {name: getattr(second.steps, name)._cache_size() for name in second.steps._fields} == compiled
    assert tree_equal(second.state, first.state) and second.state.params is not first.state.params
    second.fit(tr[640:960], batch_size=64)
    assert first.iteration == 10 and second.iteration == 15
    # whatever changes the programs gets its own: the model, the updater's settings, the loss
    for other in (make_net(MLP(hidden=32)), make_net(updater=optax.adam(1e-3)), make_net(loss="mse")):
        assert other.steps is not first.steps
    # an updater that cannot be pickled: its network builds its own steps and trains
    lock, adam = threading.Lock(), optax.adam(1e-2)

    def update(updates, state, params=None):
        with lock:
            return adam.update(updates, state, params)

    odd = make_net(updater=optax.GradientTransformation(adam.init, update))
    assert odd.steps is not make_net(updater=optax.GradientTransformation(adam.init, update)).steps
    odd.fit(tr[:640], batch_size=64)
    assert tree_equal(odd.state.params, first.state.params)


@pytest.mark.usefixtures("fresh_steps")
def test_train_step_is_compiled_once(make_net, digits):
    tr, _ = digits
    net = make_net()
    net.fit(tr[:640], batch_size=64)
    net.fit(tr[:640], batch_size=64)
    # local fit runs the bare step under either policy; train_step only replays a window
    # that held a non-finite step
    assert net.steps.bare_step._cache_size() == 1
    assert net.steps.train_step._cache_size() == 0
    skipper = make_net(on_nonfinite="skip")
    skipper.fit(tr[:640], batch_size=64)
    skipper.fit(tr[:640], batch_size=64)
    assert skipper.steps.bare_step._cache_size() == 1


def test_a_non_finite_step_mid_fit_stops_there_though_later_steps_were_already_queued(make_net, digits):
    # Local fit reads losses back every few dozen steps; the steps queued after a bad one
    # must change nothing, so that the network stops exactly where the bad step was.
    tr, _ = digits
    bad = tr.features[:32].copy()
    bad[0, 0] = np.inf
    good = tr[:320].batches(32)
    batches = good[:3] + [DataSet(bad, tr.labels[:32])] + good[3:]
    net = make_net()
    with pytest.raises(NonFiniteLossError, match="iteration 3"):
        net.fit(batches)
    ref = make_net()
    ref.fit(good[:3])
    assert net.iteration == 3 and len(net.score_history) == 3
    for x, y in zip(jax.tree_util.tree_leaves(net.state.params), jax.tree_util.tree_leaves(ref.state.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_a_non_finite_update_behind_a_finite_loss_is_caught(make_net, digits):
    # Local fit checks a window's losses and the parameters at its end; an update that is not
    # finite while the loss is must still stop the fit at its step.
    tr, _ = digits
    bad = tr.features[:32].copy()
    bad[0, 0] = np.inf
    good = tr[:320].batches(32)
    net = make_net(module=FiniteOutputs())
    with pytest.raises(NonFiniteLossError, match="iteration 2"):
        net.fit(good[:2] + [DataSet(bad, tr.labels[:32])] + good[2:])
    ref = make_net(module=FiniteOutputs())
    ref.fit(good[:2])
    assert net.iteration == 2 and len(net.score_history) == 2
    for x, y in zip(jax.tree_util.tree_leaves(net.state.params), jax.tree_util.tree_leaves(ref.state.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_skip_mid_window_replays_the_window_and_leaves_out_only_the_bad_step(make_net, digits):
    # The window of steps read back together is replayed from its start when one step was
    # not finite: the steps after the bad one must train as if it had not been there.
    tr, _ = digits
    bad = tr.features[:32].copy()
    bad[0, 0] = np.nan
    good = tr[:320].batches(32)
    skipper = make_net(on_nonfinite="skip")
    skipper.fit(good[:4] + [DataSet(bad, tr.labels[:32])] + good[4:])
    ref = make_net()
    ref.fit(good)
    assert skipper.iteration == len(good) and len(skipper.score_history) == len(good)
    np.testing.assert_allclose([x for _, x in skipper.score_history], [x for _, x in ref.score_history],
                               rtol=1e-5)
    for x, y in zip(jax.tree_util.tree_leaves(skipper.state.params), jax.tree_util.tree_leaves(ref.state.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("fresh_steps")
@pytest.mark.parametrize("steps_per_call", [None, 1])
def test_a_non_finite_step_in_a_later_window_is_replayed_from_that_window_s_start(make_net, digits, steps_per_call):
    # A window is replayed from the copy of the state the previous window ended with: past the
    # first window, that copy must be the state this window began with. By default the bad
    # minibatch is inside a fused call of 16; with steps_per_call=1 it is a call of its own.
    from dlspark.network import _SYNC_EVERY

    tr, _ = digits
    good = tr[:8 * (_SYNC_EVERY + 40)].batches(8)
    at = _SYNC_EVERY + 20  # in the second window
    bad = good[at].features.copy()
    bad[0, 0] = np.nan
    batches = good[:at] + [DataSet(bad, good[at].labels)] + good[at:]
    skipper = make_net(on_nonfinite="skip")
    skipper.fit(batches, steps_per_call=steps_per_call)
    assert (skipper.steps.loop_steps._cache_size() > 0) == (steps_per_call is None)
    ref = make_net()
    ref.fit(good)
    assert skipper.iteration == len(good) == len(skipper.score_history)
    for x, y in zip(jax.tree_util.tree_leaves(skipper.state.params), jax.tree_util.tree_leaves(ref.state.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    raiser = make_net()
    with pytest.raises(NonFiniteLossError, match=f"iteration {at}"):
        raiser.fit(batches, steps_per_call=steps_per_call)
    upto = make_net()
    upto.fit(good[:at])
    assert raiser.iteration == at == len(raiser.score_history)
    for x, y in zip(jax.tree_util.tree_leaves(raiser.state.params), jax.tree_util.tree_leaves(upto.state.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_a_fit_compiles_each_minibatch_shape_once_wherever_it_falls(make_net, digits):
    # Warming up on every shape once must be enough: a shape met at another position of a
    # later fit (a window's first step or not, a fresh state) compiles nothing new.
    tr, _ = digits
    batches = tr[:16 * 20 + 5].batches(16)  # 20 full minibatches and one of 5
    net = make_net()
    net.fit(batches[-1:] + batches[:-1])
    sizes = {name: getattr(net.steps, name)._cache_size() for name in net.steps._fields}
    net.state = net.init_state()
    net.fit(batches)
    net.fit(batches[:3] + batches[-1:])
    assert {name: getattr(net.steps, name)._cache_size() for name in net.steps._fields} == sizes


def test_fit_fuses_runs_of_same_shape_minibatches_with_the_bits_of_one_call_each(make_net, digits):
    # 40 minibatches of 16 and one of 5, shuffled so that the short one falls mid-run: the
    # default fuses runs of 16 into one call, and every count must train as one call per step.
    tr, _ = digits
    batches = tr[:16 * 40 + 5].batches(16)
    nets, sizes = {}, {}
    for k in (None, 1, 7):
        dlspark.network.clear_shared_steps()  # each net compiles its own, to be counted
        net = nets[k] = make_net(module=MLP(dropout=0.2))
        net.fit(batches, epochs=3, shuffle=True, steps_per_call=k)
        assert net.iteration == 3 * 41 and net.epoch == 3
        sizes[k] = net.steps.loop_steps._cache_size()
    assert sizes[None] == 1  # one program for every fused call
    assert sizes[1] == 0
    for k in (None, 7):
        assert tree_equal(nets[k].state, nets[1].state)
        assert nets[k].score_history == nets[1].score_history


def test_fused_calls_span_windows_and_shape_changes_with_the_bits_of_one_call_each(make_net, digits):
    # 176 minibatches in one epoch, two runs of the short shape among them: the loss windows
    # close mid-call-sequence (and past 128 steps with 7 per call).
    tr, _ = digits
    small, odd = tr[:8 * 170].batches(8), tr[:5 * 6].batches(5)
    batches = small[:50] + odd[:3] + small[50:130] + odd[3:] + small[130:]
    nets, sizes = {}, {}
    for k in (1, None, 7):
        dlspark.network.clear_shared_steps()  # each net compiles its own, to be counted
        net = nets[k] = make_net()
        net.fit(batches, epochs=2, steps_per_call=k)
        assert net.iteration == 2 * 176 and net.epoch == 2
        sizes[k] = net.steps.loop_steps._cache_size()
    for k in (None, 7):
        assert sizes[k] == 1
        assert tree_equal(nets[k].state, nets[1].state)
        assert nets[k].score_history == nets[1].score_history


@pytest.mark.parametrize("steps_per_call", [None, 1])
def test_a_minibatch_that_cannot_be_fed_ends_the_fit_after_the_ones_before_it(make_net, digits, steps_per_call):
    # Position 20: 16 of the 20 before it would be one fused call, 4 still waiting for theirs.
    tr, _ = digits
    good = tr[:16 * 30].batches(16)
    wrong = DataSet(tr.features[:16, :63], tr.labels[:16])
    net = make_net()
    with pytest.raises(ValueError, match="cannot take features of shape"):
        net.fit(good[:20] + [wrong] + good[20:], steps_per_call=steps_per_call)
    ref = make_net()
    ref.fit(good[:20], steps_per_call=1)
    assert net.iteration == 20 and net.score_history == ref.score_history
    assert tree_equal(net.state.params, ref.state.params)
    net.fit(good)  # the network goes on from there
    assert net.iteration == 50


@pytest.mark.usefixtures("fresh_steps")
def test_fit_steps_one_call_per_minibatch_for_convolutions_and_large_minibatches(make_net, digits):
    class Conv(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(4, (3, 3))(x.reshape(x.shape[0], 8, 8, 1)))
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    tr, _ = digits
    batches = tr[:16 * 20].batches(16)
    conv = make_net(module=Conv())
    conv.fit(batches)
    assert conv.iteration == 20
    assert conv.steps.loop_steps._cache_size() == 0 and conv.steps.bare_step._cache_size() == 1
    conv.fit(batches, steps_per_call=16)  # asked for: fused all the same
    assert conv.steps.loop_steps._cache_size() == 1
    mlp = make_net()
    large = (np.zeros((4200, 64), np.float32), np.zeros((4200, 10), np.float32), None, None)  # 1.2 MiB
    assert mlp._fused_steps(large) == 1
    assert mlp._fused_steps(batches[0].jit_batch()) == 16


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "16"])
def test_fit_refuses_a_steps_per_call_that_is_not_a_positive_integer(make_net, digits, bad):
    tr, _ = digits
    net = make_net()
    with pytest.raises(ValueError, match="steps_per_call must be a positive integer or None"):
        net.fit(tr[:64], batch_size=16, steps_per_call=bad)
    assert net.iteration == 0


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_train_steps_over_stacked_minibatches_have_the_bits_of_one_step_at_a_time(request, make_net, digits, kind):
    # Each fused form against the steps one at a time it replaces, dropout included: train_steps
    # (Network.fit's checked windows) against train_step, and an averaging round's fused call (a
    # rolled loop, unrolled for a network that convolves) against its kept_step, then bare_step.
    if not under_xla_defaults(request):  # a claim about how XLA compiles: checked at its defaults
        return
    tr, _ = digits
    # three minibatches: an averaging round's at frequency 3
    batches = [jax.tree_util.tree_map(jnp.asarray, b.jit_batch()) for b in tr[:96].batches(32)]
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *batches)
    net = make_net(module=MLP(dropout=0.2) if kind == "mlp" else SmallConv())
    steps = net.steps
    assert net._step_convolves(batches[0], net.state) == (kind == "conv")
    fused_round = steps.bare_steps if kind == "conv" else steps.loop_steps

    def one_at_a_time(first, then):
        state, losses = jax.tree_util.tree_map(jnp.copy, net.state), []
        for i, b in enumerate(batches):
            out = (then if i else first)(state, b)
            state = out.state
            losses.append(out.loss)
        return state, losses

    for fused, first, then in ((steps.train_steps, steps.train_step, steps.train_step),
                               (fused_round, steps.kept_step, steps.bare_step)):
        one, losses = one_at_a_time(first, then)
        out = fused(jax.tree_util.tree_map(jnp.copy, net.state), stacked)
        if out.finite is not None:
            assert bool(np.all(out.finite))
        np.testing.assert_array_equal(np.asarray(out.loss), np.asarray(losses))
        assert tree_equal(out.state, one), fused
