import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn import metrics

from dlspark.evaluation import (ROC, Evaluation, EvaluationBinary, EvaluationCalibration, RegressionEvaluation,
                                ROCBinary, ROCMultiClass, from_json)

seeds = st.integers(0, 2**31 - 1)


def _cls_data(seed, n, k):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    logits = rng.normal(size=(n, k)) + 1.5 * np.eye(k)[y] * rng.random()
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return y, p


@settings(max_examples=60, deadline=None)
@given(seeds, st.integers(5, 200), st.integers(2, 6))
def test_classification_matches_sklearn(seed, n, k):
    y, p = _cls_data(seed, n, k)
    e = Evaluation(num_classes=k, top_n=2)
    e.update(np.eye(k)[y], p)
    pred = p.argmax(1)
    assert e.accuracy() == pytest.approx(metrics.accuracy_score(y, pred), abs=1e-12)
    labels = np.union1d(y, pred)
    for avg in ("macro", "micro"):
        assert e.precision(averaging=avg) == pytest.approx(
            metrics.precision_score(y, pred, average=avg, labels=labels, zero_division=0), abs=1e-9)
        assert e.recall(averaging=avg) == pytest.approx(
            metrics.recall_score(y, pred, average=avg, labels=labels, zero_division=0), abs=1e-9)
        assert e.f1(averaging=avg) == pytest.approx(
            metrics.f1_score(y, pred, average=avg, labels=labels, zero_division=0), abs=1e-9)
    per = metrics.precision_score(y, pred, average=None, labels=range(k), zero_division=0)
    assert [e.precision(c) for c in range(k)] == pytest.approx(per, abs=1e-12)
    np.testing.assert_array_equal(e.confusion_matrix(), metrics.confusion_matrix(y, pred, labels=range(k)))
    top2 = np.argsort(-p, axis=1, kind="stable")[:, :2]
    assert e.top_n_accuracy() == pytest.approx((top2 == y[:, None]).any(1).mean(), abs=1e-12)
    if k > 2:
        assert e.top_n_accuracy() == pytest.approx(metrics.top_k_accuracy_score(y, p, k=2, labels=range(k)), abs=1e-12)
    # integer labels give the same result
    e2 = Evaluation(num_classes=k, top_n=2)
    e2.update(y.astype(np.int32), p)
    assert e2 == e


@settings(max_examples=60, deadline=None)
@given(seeds, st.integers(4, 300))
def test_exact_roc_matches_sklearn(seed, n):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    if y.min() == y.max():
        y[0] = 1 - y[0]
    s = np.round(rng.random(n), 2)  # ties on purpose
    roc = ROC(threshold_steps=0)
    roc.update(y, s)
    assert roc.calculate_auc() == pytest.approx(metrics.roc_auc_score(y, s), abs=1e-9)
    assert roc.calculate_auprc() == pytest.approx(metrics.average_precision_score(y, s), abs=1e-9)
    two = ROC()
    two.update(np.eye(2)[y], np.c_[1 - s, s])  # two-column softmax form
    assert two.calculate_auc() == pytest.approx(roc.calculate_auc(), abs=1e-12)


def test_histogram_roc_approximates_exact():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 5000)
    s = np.clip(0.3 * y + rng.random(5000) * 0.7, 0, 1)
    exact = metrics.roc_auc_score(y, s)
    hist = ROC(threshold_steps=100)
    hist.update(y, s)
    # binning to 1/100 only merges scores within a bin: error bounded by the ties it creates
    assert abs(hist.calculate_auc() - exact) < 0.01
    fpr, tpr, thr = hist.roc_curve()
    assert len(fpr) == 101 and fpr[0] == 0 and fpr[-1] == 1 and tpr[-1] == 1


@settings(max_examples=60, deadline=None)
@given(seeds, st.integers(3, 200), st.integers(1, 4))
def test_regression_matches_sklearn(seed, n, c):
    rng = np.random.default_rng(seed)
    y = rng.normal(size=(n, c))
    p = y * rng.random() + rng.normal(size=(n, c))
    r = RegressionEvaluation()
    r.update(y, p)
    for j in range(c):
        assert r.mean_squared_error(j) == pytest.approx(metrics.mean_squared_error(y[:, j], p[:, j]), rel=1e-9)
        assert r.mean_absolute_error(j) == pytest.approx(metrics.mean_absolute_error(y[:, j], p[:, j]), rel=1e-9)
        assert r.r_squared(j) == pytest.approx(metrics.r2_score(y[:, j], p[:, j]), rel=1e-9, abs=1e-9)
        assert r.pearson_correlation(j) == pytest.approx(np.corrcoef(y[:, j], p[:, j])[0, 1], rel=1e-9, abs=1e-9)


def _all_evals():
    return [Evaluation(), EvaluationBinary(), ROC(), ROC(threshold_steps=20), ROCBinary(), ROCMultiClass(),
            RegressionEvaluation(), EvaluationCalibration()]


def _feed(ev, y, p):
    if isinstance(ev, ROC):
        ev.update(y[:, :1], p[:, :1])
    elif isinstance(ev, (EvaluationBinary, ROCBinary)) and not isinstance(ev, ROCMultiClass):
        ev.update(y, p)
    else:
        ev.update(y, p)


@pytest.mark.parametrize("make", range(8))
def test_merge_is_associative_equals_single_pass_and_json_is_exact(make):
    rng = np.random.default_rng(make)
    k = 3
    ys = [np.eye(k)[rng.integers(0, k, 40)] for _ in range(3)]
    ps = [rng.dirichlet(np.ones(k), 40) for _ in range(3)]
    parts = []
    for y, p in zip(ys, ps):
        ev = _all_evals()[make]
        _feed(ev, y, p)
        parts.append(ev)
    whole = _all_evals()[make]
    _feed(whole, np.concatenate(ys), np.concatenate(ps))
    left = from_json(parts[0].to_json()).merge(from_json(parts[1].to_json())).merge(from_json(parts[2].to_json()))
    right = from_json(parts[0].to_json()).merge(from_json(parts[1].to_json()).merge(from_json(parts[2].to_json())))
    for a in (left, right):
        assert a.stats() == whole.stats()
    back = type(whole).from_json(whole.to_json())
    assert back == whole and back.to_json() == whole.to_json()


def test_masks_drop_time_steps_and_examples():
    rng = np.random.default_rng(0)
    y = np.eye(3)[rng.integers(0, 3, (4, 5))]
    p = rng.dirichlet(np.ones(3), (4, 5))
    mask = np.ones((4, 5))
    mask[:, 3:] = 0
    e = Evaluation()
    e.update(y, p, mask)
    ref = Evaluation()
    ref.update(y[:, :3].reshape(-1, 3), p[:, :3].reshape(-1, 3))
    assert e == ref and e.count == 12
    ex = Evaluation()
    ex.update(y[:, 0], p[:, 0], mask=np.array([1, 0, 1, 0]))
    assert ex.count == 2


def test_bad_inputs_raise_clear_errors():
    e = Evaluation(num_classes=3)
    with pytest.raises(ValueError, match="this Evaluation has 3 classes"):
        e.update(np.eye(4)[[0, 1]], np.eye(4)[[0, 1]])
    with pytest.raises(ValueError, match=r"labels of shape \(2, 2\) do not match predictions of shape \(2, 3\)"):
        Evaluation().update(np.eye(2)[[0, 1]], np.eye(3)[[0, 1]])
    with pytest.raises(ValueError, match="mask of shape"):
        Evaluation().update(np.eye(3)[[0, 1]], np.eye(3)[[0, 1]], mask=np.ones(5))
    with pytest.raises(ValueError, match="ROC takes 1 or 2 output columns"):
        ROC().update(np.eye(3)[[0, 1]], np.eye(3)[[0, 1]])
    with pytest.raises(ValueError, match="no data"):
        Evaluation().accuracy()
    with pytest.raises(TypeError, match="cannot merge ROC into Evaluation"):
        Evaluation().merge(ROC())
    with pytest.raises(ValueError, match="threshold_steps must be an integer >= 0"):
        ROC(threshold_steps=-1)


def test_binary_threshold_and_cost_array_and_calibration():
    y = np.eye(2)[[0, 1, 1, 0]]
    p = np.array([[0.7, 0.3], [0.4, 0.6], [0.8, 0.2], [0.9, 0.1]])
    e = Evaluation(binary_threshold=0.25)
    e.update(y, p)
    assert e.confusion_matrix().tolist() == [[1, 1], [1, 1]]
    c = Evaluation(cost_array=[1.0, 5.0])
    c.update(y, p)
    assert c.confusion_matrix().tolist() == [[1, 1], [0, 2]]
    cal = EvaluationCalibration(reliability_bins=2, histogram_bins=4)
    cal.update(y, p)
    mean_p, frac = cal.reliability_diagram(1)
    np.testing.assert_allclose(mean_p, [0.2, 0.6])
    np.testing.assert_allclose(frac, [1 / 3, 1.0])
    assert cal.probability_histogram(1).sum() == 4
