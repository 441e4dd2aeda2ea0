"""Distributed evaluation, keyed inference and scoring on a real LocalCluster."""

import os

import numpy as np
import optax
import pytest
from conftest import MLP

import dlspark
from dlspark import DataSet, DistributedTrainer, Network
from dlspark._inference import evaluation_outputs
from dlspark.evaluation import ROC, Evaluation, EvaluationCalibration, RegressionEvaluation, ROCMultiClass

pytestmark = pytest.mark.slow




@pytest.fixture(scope="module")
def trained(digits, tmp_path_factory):
    tr, _ = digits
    model = dlspark.Model.from_flax(MLP(hidden=64), tr.features[:1])
    net = Network(model, updater=optax.adam(1e-2))
    net.fit(tr, epochs=5, batch_size=32)
    url = str(tmp_path_factory.mktemp("net") / "digits.dls")
    net.save(url)
    return url


def _local(net, te, *evals):
    # evaluations see probabilities: the softmax of the digits network's logits
    out = evaluation_outputs(net, net.output(te.features))
    for e in evals:
        e.update(te.labels, out)
    return evals


def test_distributed_evaluation_equals_local(client2, trained, digits, tmp_path):
    _, te = digits
    net = Network.load(trained)
    trainer = DistributedTrainer(client2, Network.load(trained), progress=False)  # no master: inference only
    local = _local(net, te, Evaluation(), ROCMultiClass(), EvaluationCalibration())
    dist = trainer.do_evaluation(te, 32, Evaluation(), ROCMultiClass(), EvaluationCalibration())
    for a, b in zip(local, dist):
        assert a.stats() == b.stats()
    assert dist[0].confusion_matrix().tolist() == local[0].confusion_matrix().tolist()
    assert dist[1].calculate_average_auc() == pytest.approx(local[1].calculate_average_auc(), abs=1e-12)
    assert trainer.evaluate(te).accuracy() == pytest.approx(local[0].accuracy())
    # from files, with a loader that records every read: three evaluations, one read per file
    urls = dlspark.data.save_minibatches(te, url=str(tmp_path / "te"), batch_size=50)
    log = tmp_path / "reads"
    log.mkdir()

    def counting_loader(url, _log=str(log)):
        open(os.path.join(_log, os.path.basename(url)), "a").write("x")
        return dlspark.data.load_minibatch(url)

    ev, roc, cal = trainer.do_evaluation(str(tmp_path / "te"), 32, Evaluation(), ROCMultiClass(),
                                         EvaluationCalibration(), loader=counting_loader)
    assert ev.stats() == local[0].stats()
    reads = sorted(p.name for p in log.iterdir())
    assert reads == sorted(os.path.basename(u) for u in urls)
    assert all((log / r).read_text() == "x" for r in reads)


def test_roc_and_regression_entry_points(client2, digits):
    _, te = digits
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [2.0], [-1.0], [0.5]], np.float32)).astype(np.float32)
    import jax
    import jax.numpy as jnp

    model = dlspark.Model(lambda k, xb: {"w": jax.random.normal(k, (4, 1))}, lambda v, xb, t, k: xb @ v["w"], x[:1])
    net = Network(model, loss="mse", updater=optax.sgd(0.05))
    net.fit((x, y), epochs=20, batch_size=30)
    trainer = DistributedTrainer(client2, net, progress=False)
    reg = trainer.evaluate_regression((x, y))
    local = RegressionEvaluation()
    local.update(y, net.output(x))
    assert reg.mean_squared_error(0) == pytest.approx(local.mean_squared_error(0), rel=1e-9)
    assert reg.r_squared(0) > 0.9
    # binary ROC through a 1-column sigmoid-style score
    bin_model = dlspark.Model(lambda k, xb: {"w": jnp.ones((4, 1))}, lambda v, xb, t, k: jax.nn.sigmoid(xb @ v["w"]), x[:1])
    bin_net = Network(bin_model, loss="mse")
    labels = (x.sum(1, keepdims=True) > 0).astype(np.float32)
    roc = DistributedTrainer(client2, bin_net, progress=False).evaluate_roc((x, labels))
    local_roc = ROC()
    local_roc.update(labels, bin_net.output(x))
    assert roc.calculate_auc() == pytest.approx(local_roc.calculate_auc(), abs=1e-12) == pytest.approx(1.0)


def test_predict_with_keys_shuffled_10000(client2, trained):
    net = Network.load(trained)
    trainer = DistributedTrainer(client2, Network.load(trained), progress=False)
    rng = np.random.default_rng(0)
    feats = rng.random((10_000, 64)).astype(np.float32)
    keys = [f"k{i}" for i in rng.permutation(10_000)]
    pairs = list(zip(keys, feats))
    out = trainer.predict_with_keys(pairs, batch_size=128)
    assert [k for k, _ in out] == keys
    expected = net.output(feats)
    np.testing.assert_allclose(np.stack([o for _, o in out]), expected, rtol=1e-5, atol=1e-5)
    as_dict = trainer.predict_with_keys(dict(pairs[:500]), batch_size=7)
    assert set(as_dict) == set(keys[:500])
    np.testing.assert_allclose(as_dict[keys[3]], expected[3], rtol=1e-5, atol=1e-5)
    import dask.bag as db

    bag_out = dict(trainer.predict_with_keys(db.from_sequence(pairs[:300], npartitions=3)).compute())
    np.testing.assert_allclose(bag_out[keys[299]], expected[299], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="duplicate key 'k"):
        trainer.predict_with_keys(pairs[:5] + pairs[:1])


def test_score_examples_and_calculate_score(client2, trained, digits):
    _, te = digits
    net = Network.load(trained)
    trainer = DistributedTrainer(client2, Network.load(trained), progress=False)
    per = trainer.score_examples(te)
    np.testing.assert_allclose(per, net.score_examples(te), rtol=1e-5, atol=1e-6)
    assert trainer.calculate_score(te) == pytest.approx(net.score(te), rel=1e-5)
    keyed = {f"e{i}": DataSet(te.features[i:i + 1], te.labels[i:i + 1]) for i in range(20)}
    scored = trainer.score_examples(keyed)
    assert set(scored) == set(keyed)
    assert scored["e7"] == pytest.approx(float(per[7]), rel=1e-5)
    assert trainer.calculate_score(keyed) == pytest.approx(float(per[:20].mean()), rel=1e-5)
    # a per-example label mask: a masked-out example scores 0 (as DL4J's score arrays), and
    # the sum over examples is the masked loss's
    mask = (np.arange(len(te)) % 3 != 0).astype(np.float32)
    masked = DataSet(te.features, te.labels, labels_mask=mask)
    local = net.score_examples(masked)
    np.testing.assert_allclose(local, per * mask, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trainer.score_examples(masked), local, rtol=1e-5, atol=1e-6)
    assert float(local.sum() / mask.sum()) == pytest.approx(net.score(masked), rel=1e-5)


def test_an_evaluation_with_data_in_it_adds_the_new_data_once(client2, trained, digits):
    # DL4J's users fill one evaluation over several calls; each part fills a blank copy, so
    # what the evaluation held counts once, not once per part. An evaluation that saw no
    # data merges with any other (an empty part, a dask bag's filtered-out partition).
    import dask.bag as db

    _, te = digits
    net = Network.load(trained)
    trainer = DistributedTrainer(client2, Network.load(trained), progress=False)
    local = _local(net, te, Evaluation(), RegressionEvaluation())
    ev, reg = Evaluation(), RegressionEvaluation()
    half = len(te) // 2
    trainer.do_evaluation(te[:half], 32, ev, reg)
    trainer.do_evaluation(te[half:], 32, ev, reg)
    assert ev.count == len(te) and ev.stats() == local[0].stats()
    np.testing.assert_allclose(reg.mean_squared_error(0), local[1].mean_squared_error(0), rtol=1e-9)
    filled = _local(net, te, Evaluation())[0]
    assert Evaluation().merge(filled).stats() == filled.stats()
    assert filled.merge(Evaluation()).stats() == local[0].stats()
    parts = [te[i:i + 10] for i in range(0, 40, 10)]
    bag = db.from_sequence(parts, npartitions=4).filter(lambda d, first=te.features[0]: not np.array_equal(
        d.features[0], first))  # partition 0 ends empty
    from_bag = trainer.evaluate(bag)
    assert from_bag.count == 30 and from_bag.stats() == _local(net, te[10:40], Evaluation())[0].stats()


def test_bad_evaluation_input(client2, trained, digits):
    _, te = digits
    trainer = DistributedTrainer(client2, Network.load(trained), progress=False)
    with pytest.raises(ValueError, match="labels of shape .* do not match predictions"):
        trainer.evaluate(DataSet(te.features, te.labels[:, :4]))
    with pytest.raises(TypeError, match="needs at least one evaluation"):
        trainer.do_evaluation(te, 32)
    with pytest.raises(ValueError, match="no master"):
        trainer.fit(te)
