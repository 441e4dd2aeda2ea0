"""Model.from_nnx, Model.from_equinox and Model.from_keras: the guarantees Model.from_flax gives linen.

Each kind is a small digits classifier with dropout and batch normalisation. The fast tests
check the adapters in this process (RNG streams, state, checkpoints, several inputs and
outputs, ParallelWrapper); the slow ones fit on the shared two-worker cluster with both
algorithms and resume a checkpoint.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before Keras is first imported, as users must

import subprocess  # noqa: E402
import sys  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from conftest import accuracy, tree_equal  # noqa: E402
from flax import nnx  # noqa: E402

import dlspark  # noqa: E402
from dlspark import (DistributedTrainer, GradientSharing, Model, MultiDataSet, Network, ParallelWrapper,  # noqa: E402
                     ParameterAveraging)

KINDS = ["nnx", "equinox", "keras"]


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(64, 64, rngs=rngs)
        self.bn = nnx.BatchNorm(64, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


class EqxNet(eqx.Module):
    l1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    drop: eqx.nn.Dropout
    l2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(64, 64, key=k1)
        self.bn = eqx.nn.BatchNorm(64, axis_name="batch", mode="batch", momentum=0.9)
        self.drop = eqx.nn.Dropout(0.2)
        self.l2 = eqx.nn.Linear(64, 10, key=k2)

    def __call__(self, x, state, *, key=None):
        h, state = self.bn(self.l1(x), state)
        return self.l2(self.drop(jax.nn.relu(h), key=key)), state


def keras_net():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64), keras.layers.BatchNormalization(momentum=0.9),
                             keras.layers.Activation("relu"), keras.layers.Dropout(0.2), keras.layers.Dense(10)])


def make_model(kind, x0):
    if kind == "nnx":
        return Model.from_nnx(NnxNet, x0)  # a factory rngs -> module: the network's seed draws the parameters
    if kind == "equinox":
        module, state = eqx.nn.make_with_state(EqxNet)(jax.random.PRNGKey(0))
        return Model.from_equinox(module, x0, state=state)
    return Model.from_keras(keras_net())


def make_network(kind, digits, lr=5e-3):
    return Network(make_model(kind, digits[0].features[:1]), updater=optax.adam(lr))


# -- in this process ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_dropout_draws_from_the_step_key_and_rng_state_is_never_in_the_state(kind, digits):
    x = digits[0].features[:64]
    model = make_model(kind, x[:1])
    params, state = model.init(jax.random.PRNGKey(0))
    # parameters and state: plain arrays (np.asarray fails on typed keys), no RNG stream in them
    leaves = jax.tree_util.tree_flatten_with_path((params, state))[0]
    for path, leaf in leaves:
        a = np.asarray(leaf)
        assert not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key), jax.tree_util.keystr(path)
        assert "rng" not in jax.tree_util.keystr(path) and "seed" not in jax.tree_util.keystr(path)
    assert state, "batch statistics are carried as state"
    k0, k1 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
    train = jax.jit(model.apply_train)
    a, new_state = train(params, state, x, k0)
    b, _ = train(params, state, x, k1)
    again, _ = train(params, state, x, k0)
    # replicas' keys (fold_in per replica, as the runtimes give them) and steps' keys draw other masks
    c, _ = train(params, state, x, jax.random.fold_in(k0, 1))
    assert not np.allclose(a, b) and not np.allclose(a, c)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(again))
    # training updates the batch statistics; inference uses them and is deterministic
    assert not tree_equal(new_state, state)
    infer = jax.jit(model.apply_eval)
    e1, e2 = infer(params, new_state, x), infer(params, new_state, x)
    np.testing.assert_array_equal(np.asarray(e1), np.asarray(e2))
    assert not np.allclose(e1, a)


@pytest.mark.parametrize("kind", KINDS)
def test_fit_checkpoint_resumes_exactly_and_loads_elsewhere(kind, digits, tmp_path):
    tr, te = digits
    data = tr[:320]
    straight = make_network(kind, digits)
    straight.fit(data, epochs=2, batch_size=32)
    first = make_network(kind, digits)
    first.fit(data, epochs=1, batch_size=32)
    url = str(tmp_path / "net.dls")
    first.save(url)
    meta = dlspark.checkpoint.read_checkpoint_meta(url)
    assert not any("key" in leaf["dtype"] for leaf in meta["leaves"])  # keys stored as key data, if at all
    resumed = make_network(kind, digits).restore(url)
    resumed.fit(data, epochs=1, batch_size=32)
    assert tree_equal(resumed.state, straight.state)  # parameters, batch statistics, updater, step, key
    loaded = Network.load(url)  # the definition pickled, model included
    np.testing.assert_array_equal(loaded.output(te.features[:50]), first.output(te.features[:50]))


@pytest.mark.parametrize("kind", KINDS)
def test_parallel_wrapper_trains_it(kind, digits):
    tr, te = digits
    net = make_network(kind, digits, lr=1e-2)
    before = accuracy(net, te)
    ParallelWrapper(net, ParameterAveraging(batch_size_per_worker=16, averaging_frequency=4),
                    jax.devices("cpu")[:2], progress=False).fit(tr[:640], epochs=2)
    assert before < 0.3 and accuracy(net, te) >= 0.85


class NnxTwo(nnx.Module):
    def __init__(self, rngs):
        self.a, self.b, self.c = nnx.Linear(4, 3, rngs=rngs), nnx.Linear(2, 3, rngs=rngs), nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        return self.a(x[0]) + self.b(x[1]), self.c(x[0])


class EqxTwo(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear
    c: eqx.nn.Linear

    def __init__(self, key):
        ka, kb, kc = jax.random.split(key, 3)
        self.a, self.b, self.c = eqx.nn.Linear(4, 3, key=ka), eqx.nn.Linear(2, 3, key=kb), eqx.nn.Linear(4, 1, key=kc)

    def __call__(self, x):
        return self.a(x[0]) + self.b(x[1]), self.c(x[0])


def keras_two():
    keras.utils.set_random_seed(0)
    a, b = keras.Input((4,)), keras.Input((2,))
    cls = keras.layers.Add()([keras.layers.Dense(3)(a), keras.layers.Dense(3)(b)])
    return keras.Model([a, b], [cls, keras.layers.Dense(1)(a)])


@pytest.mark.parametrize("kind", KINDS)
def test_several_inputs_and_outputs(kind, tmp_path):
    rng = np.random.default_rng(0)
    xa, xb = rng.normal(size=(96, 4)).astype(np.float32), rng.normal(size=(96, 2)).astype(np.float32)
    ids = (xa[:, 0] + xb[:, 1] > 0).astype(np.int32) + (xa[:, 1] > 1)
    reg = (xa.sum(1, keepdims=True) * 0.5).astype(np.float32)
    ex = (xa[:1], xb[:1])
    model = {"nnx": lambda: Model.from_nnx(NnxTwo, ex), "equinox": lambda: Model.from_equinox(EqxTwo(jax.random.PRNGKey(0)), ex),
             "keras": lambda: Model.from_keras(keras_two())}[kind]()
    net = Network(model, loss=("softmax_cross_entropy", "mse"), updater=optax.adam(3e-2))
    data = MultiDataSet([xa, xb], [np.eye(3, dtype=np.float32)[ids], reg])
    before = net.score(data)
    net.fit(data, epochs=10, batch_size=32)
    assert net.score(data) < before / 2
    cls_out, reg_out = net.output((xa, xb))
    assert cls_out.shape == (96, 3) and reg_out.shape == (96, 1)
    net.save(str(tmp_path / "two.dls"))
    back = Network.load(str(tmp_path / "two.dls")).output((xa, xb))
    np.testing.assert_array_equal(back[0], cls_out)


class NnxSeq(nnx.Module):
    """Masked mean of a sequence's steps, then a linear layer: padded steps must not count."""

    def __init__(self, rngs):
        self.l = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x, mask=None):
        m = jnp.ones(x.shape[:2]) if mask is None else mask
        return self.l((x * m[..., None]).sum(1) / jnp.maximum(m.sum(1, keepdims=True), 1.0))


class EqxSeq(eqx.Module):
    """The same for one example (the adapter vmaps it over the batch, mask included)."""

    l: eqx.nn.Linear

    def __init__(self, key):
        self.l = eqx.nn.Linear(3, 2, key=key)

    def __call__(self, x, *, mask=None):
        m = jnp.ones(x.shape[:1]) if mask is None else mask
        return self.l((x * m[:, None]).sum(0) / jnp.maximum(m.sum(), 1.0))


@pytest.mark.parametrize("kind", ["nnx", "equinox"])
def test_masked_sequences_reach_the_model(kind):
    # sequences of 2-6 steps padded to 6: the features mask reaches the module's mask parameter in
    # inference and in training, so whatever the padding holds changes nothing
    rng = np.random.default_rng(0)
    n, t = 64, 6
    lengths = rng.integers(2, t + 1, size=n)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    x = rng.normal(size=(n, t, 3)).astype(np.float32)
    y = (x[:, 0, 0] > 0).astype(np.int32)
    padded = np.where(mask[..., None] > 0, x, 0.0).astype(np.float32)
    garbage = np.where(mask[..., None] > 0, x, 100.0).astype(np.float32)
    ex = x[:1]
    make = {"nnx": lambda: Model.from_nnx(NnxSeq, ex),
            "equinox": lambda: Model.from_equinox(EqxSeq(jax.random.PRNGKey(0)), ex)}[kind]
    assert make().uses_features_mask
    nets = [Network(make(), updater=optax.sgd(0.1)) for _ in range(2)]
    out = [net.output(a, features_mask=mask) for net, a in zip(nets, (padded, garbage))]
    np.testing.assert_allclose(out[0], out[1], rtol=1e-6, atol=1e-6)
    assert not np.allclose(nets[1].output(garbage), out[1], atol=1e-3)  # without the mask, the padding counts
    for net, a in zip(nets, (padded, garbage)):
        net.fit(dlspark.DataSet(a, y, features_mask=mask), epochs=2, batch_size=16)
    assert nets[0].iteration == 8
    for a, b in zip(jax.tree_util.tree_leaves(nets[0].params), jax.tree_util.tree_leaves(nets[1].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("module,call", [("flax.nnx", "from_nnx"), ("equinox", "from_equinox"), ("keras", "from_keras")])
def test_a_missing_library_names_the_extra(monkeypatch, module, call):
    monkeypatch.setitem(sys.modules, module, None)  # what an environment without the package gives import
    with pytest.raises(ImportError, match=r"Model\.%s needs .* pip install 'dlspark\[models\]'" % call):
        getattr(Model, call)(object(), np.zeros((1, 2), np.float32))


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="Model.from_equinox takes an equinox.Module, got int"):
        Model.from_equinox(3, np.zeros((1, 2), np.float32))
    with pytest.raises(TypeError, match="Model.from_keras takes a keras.Model .* got str"):
        Model.from_keras("model")
    with pytest.raises(TypeError, match="Model.from_nnx takes a flax.nnx Module or a factory rngs -> Module"):
        Model.from_nnx(3, np.zeros((1, 2), np.float32))
    with pytest.raises(TypeError, match="the factory given to Model.from_nnx must return a flax.nnx Module, got int"):
        Model.from_nnx(lambda rngs: 3, np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError, match="needs a built model"):
        Model.from_keras(keras.Sequential([keras.layers.Dense(2)]))


def test_keras_on_another_backend_is_refused_naming_the_variable():
    code = ("import os; os.environ['KERAS_BACKEND'] = 'numpy'; import keras, numpy as np, dlspark\n"
            "dlspark.Model.from_keras(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "RuntimeError: Model.from_keras needs Keras on its JAX backend, but Keras runs on 'numpy'" in out.stderr
    assert "KERAS_BACKEND=jax" in out.stderr


def test_worker_env_sets_the_keras_backend():
    from dlspark.cluster import worker_env

    assert worker_env()["KERAS_BACKEND"] == "jax"


# -- on the shared two-worker cluster -------------------------------------------------------
_TARGETS = {}  # kind -> the single process's test accuracy less a point: one fit serves both algorithms


def _single_target(kind, digits):
    if kind not in _TARGETS:
        single = make_network(kind, digits)
        single.fit(digits[0], epochs=4, batch_size=32)
        _TARGETS[kind] = accuracy(single, digits[1]) - 0.01
    return _TARGETS[kind]


def _reaches(trainer, net, te, target, epochs, tr):
    for _ in range(epochs):
        trainer.fit(tr)
        if accuracy(net, te) >= target:
            break
    return accuracy(net, te)


@pytest.mark.slow
@pytest.mark.timeout(900)  # up to 8 epochs on two workers after a single-process fit
@pytest.mark.parametrize("algorithm", ["averaging", "sharing"])
@pytest.mark.parametrize("kind", KINDS)
def test_two_workers_reach_the_single_process_accuracy(client2, kind, algorithm, digits):
    # The accuracy rule: a 2-worker fit reaches the single process's accuracy within a point,
    # trained epoch by epoch up to twice the single process's epochs (three times under gradient
    # sharing, whose delivery order varies from run to run; a fit stops as soon as it is there).
    tr, te = digits
    target = _single_target(kind, digits)
    assert target > 0.9
    master = (ParameterAveraging(batch_size_per_worker=16, averaging_frequency=4) if algorithm == "averaging"
              else GradientSharing(batch_size_per_worker=16))
    net = make_network(kind, digits)
    trainer = DistributedTrainer(client2, net, master, progress=False)
    acc = _reaches(trainer, net, te, target, 8 if algorithm == "averaging" else 12, tr)
    trainer.close()
    assert acc >= target, (acc, target)
    # the batch statistics trained with the parameters (not the initial ones)
    assert not tree_equal(net.state.model_state, make_network(kind, digits).state.model_state)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_distributed_checkpoint_resumes_exactly(client2, kind, digits, tmp_path):
    # each worker draws its own dropout masks; the checkpoint keeps every worker's key
    tr, _ = digits
    data = tr[:640]
    url = str(tmp_path / "ck.dls")
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2)
    straight = make_network(kind, digits)
    DistributedTrainer(client2, straight, master, progress=False).fit(data, epochs=2, checkpoint_every=7,
                                                                       checkpoint_url=url)
    resumed = make_network(kind, digits)
    DistributedTrainer(client2, resumed, master, progress=False).fit(data, epochs=2, resume_from=url)
    assert (resumed.iteration, resumed.epoch) == (straight.iteration, straight.epoch) == (40, 2)
    for a, b in zip(jax.tree_util.tree_leaves((resumed.state.params, resumed.state.model_state)),
                    jax.tree_util.tree_leaves((straight.state.params, straight.state.model_state))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
