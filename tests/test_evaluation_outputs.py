"""Evaluations receive probabilities: the loss's output activation applied to networks that output logits.

Each network here outputs logits of a wide range (as trained classifiers do), and every
evaluation is checked against scikit-learn on the softmax or sigmoid of those logits,
through the two runtimes' evaluation path: ParallelWrapper in this process, and the
function every cluster worker (and Spark executor) runs, ``evaluate_part``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import expit, softmax
from sklearn import calibration, metrics

import dlspark
from dlspark import Network, ParallelWrapper
from dlspark._inference import evaluate_part, network_blob
from dlspark.evaluation import ROC, Evaluation, EvaluationBinary, EvaluationCalibration, ROCBinary, ROCMultiClass

N = 600


def _logit_net(columns, loss, seed=0):
    """A fixed linear network (no training needed) whose outputs are logits spread over about +-8."""
    w = np.random.default_rng(seed).normal(size=(6, columns)).astype(np.float32) * 2.0

    def init(rng, x):
        return {"w": jnp.asarray(w)}

    def apply(v, x, train, rng):
        return x @ v["w"]

    return Network(dlspark.Model(init, apply, np.zeros((1, 6), np.float32)), loss=loss)


def _data(net, kind, seed=1):
    """Features, and labels drawn from the network's own probabilities (so the AUCs are informative)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 6)).astype(np.float32)
    logits = np.asarray(net.output(x), np.float64)
    if kind == "softmax":
        p = softmax(logits, axis=1)
        ids = np.array([rng.choice(p.shape[1], p=row / row.sum()) for row in p])
        return x, np.eye(p.shape[1], dtype=np.float32)[ids], p
    p = expit(logits)
    return x, (rng.random(p.shape) < p).astype(np.float32), p


def _evaluate(runtime, net, x, y, *evaluations):
    if runtime == "parallel":
        return ParallelWrapper(net, devices=jax.devices("cpu")[:1], progress=False).do_evaluation(
            (x, y), 64, *evaluations)
    # what a cluster worker runs for its part of the data (the blob is what the client scatters)
    return evaluate_part(network_blob(net, "v1"), [dlspark.DataSet(x, y)], list(evaluations), 64)


RUNTIMES = ["parallel", "worker"]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_roc_of_a_two_column_softmax_matches_sklearn(runtime):
    net = _logit_net(2, "softmax_cross_entropy")
    x, y, p = _data(net, "softmax")
    exact, hist = _evaluate(runtime, net, x, y, ROC(0), ROC(32))
    want = metrics.roc_auc_score(y[:, 1], p[:, 1])
    assert exact.calculate_auc() == pytest.approx(want, abs=1e-12)
    assert exact.calculate_auprc() == pytest.approx(metrics.average_precision_score(y[:, 1], p[:, 1]), abs=1e-12)
    # 32 bins over [0, 1] of the probability: the trapezoid over 33 points is within a point of exact
    assert hist.calculate_auc() == pytest.approx(want, abs=0.01)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_roc_multiclass_matches_sklearn_one_vs_rest(runtime):
    net = _logit_net(4, "mcxent")
    x, y, p = _data(net, "softmax")
    exact, hist = _evaluate(runtime, net, x, y, ROCMultiClass(0), ROCMultiClass(32))
    for c in range(4):
        want = metrics.roc_auc_score(y[:, c], p[:, c])
        assert exact.calculate_auc(c) == pytest.approx(want, abs=1e-12)
        assert hist.calculate_auc(c) == pytest.approx(want, abs=0.015)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_sigmoid_outputs_roc_binary_evaluation_binary_and_one_column_evaluation(runtime):
    net = _logit_net(3, "binary_cross_entropy")
    x, y, p = _data(net, "sigmoid")
    hist, binary = _evaluate(runtime, net, x, y, ROCBinary(32), EvaluationBinary(threshold=0.7))
    for c in range(3):
        assert hist.calculate_auc(c) == pytest.approx(metrics.roc_auc_score(y[:, c], p[:, c]), abs=0.01)
        pred = p[:, c] >= 0.7
        assert binary.precision(c) == pytest.approx(metrics.precision_score(y[:, c], pred), abs=1e-12)
        assert binary.recall(c) == pytest.approx(metrics.recall_score(y[:, c], pred), abs=1e-12)
        assert binary.accuracy(c) == pytest.approx(metrics.accuracy_score(y[:, c], pred), abs=1e-12)
    # one sigmoid column: class 1 where its probability is at least 0.5
    one = _logit_net(1, "xent", seed=3)
    x1, y1, p1 = _data(one, "sigmoid")
    [ev] = _evaluate(runtime, one, x1, y1, Evaluation())
    cm = metrics.confusion_matrix(y1[:, 0], p1[:, 0] >= 0.5, labels=[0, 1])
    assert ev.confusion_matrix().tolist() == cm.tolist()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_binary_threshold_and_cost_array_act_on_probabilities(runtime):
    net = _logit_net(2, "softmax_cross_entropy")
    x, y, p = _data(net, "softmax")
    thr, = _evaluate(runtime, net, x, y, Evaluation(binary_threshold=0.8))
    want = metrics.confusion_matrix(y.argmax(1), (p[:, 1] >= 0.8).astype(int), labels=[0, 1])
    assert thr.confusion_matrix().tolist() == want.tolist()
    net3 = _logit_net(3, "softmax_cross_entropy", seed=4)
    x3, y3, p3 = _data(net3, "softmax")
    cost = [1.0, 3.0, 0.5]
    cst, = _evaluate(runtime, net3, x3, y3, Evaluation(cost_array=cost))
    want = metrics.confusion_matrix(y3.argmax(1), (p3 * np.asarray(cost)).argmax(1), labels=[0, 1, 2])
    assert cst.confusion_matrix().tolist() == want.tolist()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_calibration_bins_probabilities_as_sklearn(runtime):
    net = _logit_net(3, "softmax_cross_entropy", seed=5)
    x, y, p = _data(net, "softmax")
    cal, = _evaluate(runtime, net, x, y, EvaluationCalibration(reliability_bins=10))
    for c in range(3):
        frac_pos, mean_pred = calibration.calibration_curve(y[:, c], p[:, c], n_bins=10, strategy="uniform")
        got_pred, got_pos = cal.reliability_diagram(c)
        np.testing.assert_allclose(got_pred, mean_pred, atol=1e-12)
        np.testing.assert_allclose(got_pos, frac_pos, atol=1e-12)


def test_losses_without_an_activation_leave_outputs_as_they_are():
    net = _logit_net(1, "mse")
    x, y, _ = _data(net, "sigmoid")
    [reg] = _evaluate("parallel", net, x, y, dlspark.evaluation.RegressionEvaluation())
    out = np.asarray(net.output(x), np.float64)
    assert reg.mean_squared_error(0) == pytest.approx(metrics.mean_squared_error(y[:, 0], out[:, 0]), rel=1e-9)
