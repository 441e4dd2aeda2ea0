import subprocess
import sys

import numpy as np

from dlspark import datasets


def test_digits_split_is_real_stratified_and_reproducible():
    tr, te = datasets.digits()
    assert len(tr) + len(te) == 1797
    assert tr.features.shape[1] == 64 and tr.labels.shape[1] == 10
    assert 0.0 <= tr.features.min() and tr.features.max() <= 1.0
    counts = te.labels.sum(0)
    assert counts.min() >= 30  # every class is in the test split
    tr2, _ = datasets.digits()
    np.testing.assert_array_equal(tr.features, tr2.features)
    _, te_int = datasets.digits(one_hot=False)
    assert te_int.labels.dtype == np.int32


def test_digits_are_scikit_learns_read_without_importing_its_datasets_module():
    from sklearn.datasets import load_digits

    d = load_digits()
    tr, te = datasets.digits(one_hot=False)
    x = np.concatenate([tr.features, te.features])
    y = np.concatenate([tr.labels, te.labels])
    order = np.lexsort(np.column_stack([x, y]).T)  # the same rows as scikit-learn's, in any order
    want = np.column_stack([(d.data / 16.0).astype(np.float32), d.target.astype(np.int32)])
    np.testing.assert_array_equal(np.column_stack([x, y])[order], want[np.lexsort(want.T)])
    probe = ("import sys, dlspark; dlspark.datasets.digits(); "
             "print(sorted(m for m in sys.modules if m.startswith(('sklearn', 'scipy'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_synthetic_any_size_is_deterministic():
    a = datasets.synthetic_classification(70000, n_features=8, n_classes=3, seed=5)
    b = datasets.synthetic_classification(70000, n_features=8, n_classes=3, seed=5)
    assert a.features.shape == (70000, 8)
    np.testing.assert_array_equal(a.features, b.features)
