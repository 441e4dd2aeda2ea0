import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dlspark.algorithms.sharing import _encoding
from dlspark.algorithms.sharing._encoding import (BITMAP, HEADER_WORDS, SPARSE, bitmap_words, decode, encode_scratch,
                                           message_info, threshold_encode)
from dlspark.algorithms.sharing._thresholds import (AdaptiveThreshold, FixedThreshold, NoResidualPostProcessing,
                                             ResidualClipping, TargetSparsityThreshold, ThresholdState)

floats = st.floats(-10, 10, allow_nan=False, allow_infinity=False, width=32)
vectors = arrays(np.float32, st.integers(1, 300), elements=floats)
thresholds = st.floats(2.0 ** -20, 4.0, allow_nan=False, width=32)


@settings(max_examples=300, deadline=None)
@given(vectors, thresholds)
def test_decode_plus_residual_is_exact(r, t):
    enc = threshold_encode(r, t)
    back = decode(enc.message) + enc.residual
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, r)
    t32 = np.float32(t)
    d = decode(enc.message)
    moved = d != 0
    assert enc.count == int(moved.sum())
    assert (np.abs(r[moved]) >= t32).all() and set(np.unique(np.abs(d[moved]))) <= {t32}
    # Every element in [t, 2t) moves (the subtraction is exact there); above 2t an
    # element may rarely stay whole when no float32 residual restores it exactly.
    assert moved[(np.abs(r) >= t32) & (np.abs(r) < 2 * t32)].all()


def test_almost_every_eligible_element_moves_on_realistic_residuals():
    r = np.random.default_rng(0).normal(0, 1e-3, 200_000).astype(np.float32)
    enc = threshold_encode(r, 2e-3)
    eligible = int((np.abs(r) >= np.float32(2e-3)).sum())
    assert enc.count >= 0.99 * eligible
    np.testing.assert_array_equal(decode(enc.message) + enc.residual, r)


@settings(max_examples=200, deadline=None)
@given(vectors, thresholds)
def test_format_is_the_smaller_message_and_header_matches(r, t):
    enc = threshold_encode(r, t)
    info = message_info(enc.message)
    assert info["length"] == r.size and info["count"] == enc.count
    assert info["threshold"] == np.float32(t)
    sparse_words, bitmap = enc.count, bitmap_words(r.size)
    if enc.count == 0:
        assert info["format"] == 0 and enc.message.size == HEADER_WORDS
    elif enc.count > r.size / 16:
        assert info["format"] == BITMAP and enc.message.size == HEADER_WORDS + bitmap
        assert bitmap <= sparse_words
    else:
        assert info["format"] == SPARSE and enc.message.size == HEADER_WORDS + sparse_words
        assert sparse_words <= r.size / 16


def test_both_formats_on_known_vectors():
    r = np.zeros(64, np.float32)
    r[[3, 10]] = [0.5, -0.7]
    enc = threshold_encode(r, 0.25)
    assert enc.format == SPARSE and list(enc.message[HEADER_WORDS:]) == [4, -11]
    np.testing.assert_allclose(enc.residual[[3, 10]], [0.25, -0.45], rtol=1e-6)
    dense = np.linspace(-1, 1, 40, dtype=np.float32)
    enc = threshold_encode(dense, 0.1)
    assert enc.format == BITMAP and enc.message.size == HEADER_WORDS + 3
    with pytest.raises(ValueError, match="positive finite"):
        threshold_encode(dense, 0.0)


def _trajectory(algo, sparsities):
    s = algo.init()
    out = [s.threshold]
    for x in sparsities:
        s = algo.update(s, x)
        out.append(s.threshold)
    return out


def test_adaptive_threshold_trajectory():
    a = AdaptiveThreshold(initial=1e-3, decay=0.5)
    # too sparse -> lower; in band -> keep; too dense -> raise; bitmap step counts as 1/16 -> raise
    traj = _trajectory(a, [1e-5, 1e-5, 5e-3, 0.5, 1 / 16])
    np.testing.assert_allclose(traj, [1e-3, 5e-4, 2.5e-4, 2.5e-4, 5e-4, 1e-3])
    assert AdaptiveThreshold().decay == pytest.approx(0.5 ** (1 / 20))


def test_target_sparsity_and_fixed():
    ts = TargetSparsityThreshold(initial=1e-3, target=1e-3, decay=0.5)
    np.testing.assert_allclose(_trajectory(ts, [1e-4, 1e-2, 1e-3]), [1e-3, 5e-4, 1e-3, 1e-3])
    assert _trajectory(FixedThreshold(0.2), [0.0, 1.0]) == [0.2, 0.2, 0.2]
    red = AdaptiveThreshold().reduce([ThresholdState(1e-3), ThresholdState(3e-3)])
    assert red.threshold == pytest.approx(2e-3)


def _adam_like_steps(threshold_algorithm, steps=60, n=20000, seed=0):
    """Encode ``steps`` updates of Adam's shape (every element about the learning rate, signs
    that mostly persist) through ``threshold_algorithm``; returns each step's sparsity and the
    final state."""
    rng = np.random.default_rng(seed)
    sign, scale = rng.choice([-1.0, 1.0], n), rng.uniform(0.05, 1.0, n)
    r = np.zeros(n, np.float32)
    state, sparsities = threshold_algorithm.init(), []
    for _ in range(steps):
        flip = rng.random(n) < 0.3
        r += (1e-3 * np.where(flip, -sign, sign) * scale).astype(np.float32)
        state = threshold_algorithm.prepare(state, r)
        enc = threshold_encode(r, state.threshold, out=r)
        sparsities.append(enc.count / n)
        state = threshold_algorithm.update(state, 1 / 16 if enc.format == BITMAP else enc.count / n)
    return np.array(sparsities), state


@pytest.mark.parametrize("algorithm, aimed, band", [
    (AdaptiveThreshold(), 1e-3, (1e-4, 1e-2)),
    (AdaptiveThreshold(min_sparsity=1e-3, max_sparsity=4e-2), (1e-3 * 4e-2) ** 0.5, (1e-3, 4e-2)),
    (TargetSparsityThreshold(target=5e-3), 5e-3, (5e-3 / 3, 5e-3 * 3)),
])
def test_warm_up_holds_the_aimed_sparsity_from_the_first_step(algorithm, aimed, band):
    assert np.isnan(algorithm.init().threshold)
    sparsity, state = _adam_like_steps(algorithm)
    # the warm-up's steps send the aimed-at share of the residual, exactly (ties aside)
    np.testing.assert_allclose(sparsity[:algorithm.warmup], aimed, rtol=0.02)
    assert state.steps == 60 and np.isfinite(state.threshold)
    # steered from there: never a dense step, and on average in the band (near the target)
    after = sparsity[algorithm.warmup:]
    assert after.max() < 1 / 32 and band[0] <= after.mean() <= band[1], after


@pytest.mark.parametrize("density", [None, 1e-3])
def test_a_small_models_warm_up_sends_from_its_first_step(density):
    # 1,210 parameters (the tests' digits MLP at hidden=16): a sparsity of 1e-3 is one element,
    # and a message holds at least two. A warm-up that picked the threshold of one element sent
    # nothing and, with the residual growing under it, went on sending nothing.
    from dlspark.algorithms.sharing._state import encode_step

    algorithm, post = AdaptiveThreshold(), NoResidualPostProcessing()
    n = 1210
    rng = np.random.default_rng(0)
    update = (1e-2 * rng.choice([-1.0, 1.0], n) * rng.uniform(0.5, 1.0, n)).astype(np.float32)
    residual, state, counts = np.zeros(n, np.float32), algorithm.init(), []
    for step in range(1, algorithm.warmup + 1):
        residual += update
        encoded, residual = encode_step(algorithm, post, state, residual, encode_scratch(n), step, density=density)
        state = encoded.tstate
        counts.append(encoded.count)
    assert min(counts) >= _encoding.MIN_MESSAGE_ELEMENTS, counts


def test_a_fixed_start_as_dl4j_sends_dense_steps_first():
    # DL4J's start (1e-3) below the accumulating residual: the first steps move most elements
    sparsity, _ = _adam_like_steps(AdaptiveThreshold(initial=1e-3))
    assert sparsity[1:10].min() > 0.1
    warm, _ = _adam_like_steps(AdaptiveThreshold())
    assert warm.sum() * 10 < sparsity.sum()


def test_a_carried_threshold_does_not_warm_up_again():
    a = AdaptiveThreshold(warmup=3)
    _, state = _adam_like_steps(a, steps=5)
    red = a.reduce([state, ThresholdState(float("nan"))])
    assert red.steps == 5 and red.threshold == pytest.approx(state.threshold)
    r = np.random.default_rng(3).normal(size=1000).astype(np.float32)
    assert a.prepare(red, r) == red
    # a state from before the step count (two fields) warms up
    assert a.prepare(ThresholdState(0.5), r).threshold != 0.5
    assert AdaptiveThreshold(initial=0.5).prepare(ThresholdState(0.5), r).threshold == 0.5


@pytest.mark.parametrize("bad, match", [
    (lambda: AdaptiveThreshold(warmup=0), r"warmup must be an integer >= 1"),
    (lambda: TargetSparsityThreshold(initial=0.0), "initial must be a positive number"),
    (lambda: AdaptiveThreshold(decay=0.4), r"decay must be in \[0.5, 1\)"),
    (lambda: AdaptiveThreshold(decay=1.0), r"decay must be in \[0.5, 1\)"),
    (lambda: TargetSparsityThreshold(target=1 / 16), r"target must be in \(0, 1/16\)"),
    (lambda: AdaptiveThreshold(min_sparsity=0.1, max_sparsity=0.2), "max_sparsity < 1/16"),
    (lambda: AdaptiveThreshold(min_sparsity=1e-3, max_sparsity=1 / 16), r"max_sparsity < 1/16 \(a dense step"),
    (lambda: FixedThreshold(-1.0), "threshold must be a positive number"),
    (lambda: ResidualClipping(5, 0), "frequency must be an integer >= 1"),
])
def test_bad_parameters_name_the_allowed_range(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_residual_clipping_every_n_iterations():
    r = np.array([1.0, -1.0, 0.01], np.float32)
    clip = ResidualClipping(threshold_multiple=5, frequency=5)
    np.testing.assert_array_equal(clip.update(r.copy(), 0.1, 4), r)
    np.testing.assert_allclose(clip.update(r.copy(), 0.1, 5), [0.5, -0.5, 0.01])
    np.testing.assert_array_equal(NoResidualPostProcessing().update(r.copy(), 0.1, 5), r)


def test_in_place_with_scratch_equals_pure_and_min_count_leaves_residual_alone():
    r = np.random.default_rng(1).normal(0, 1, 5000).astype(np.float32)
    pure = threshold_encode(r, 1.5)
    work = r.copy()
    scratch = encode_scratch(r.size)
    inplace = threshold_encode(work, 1.5, out=work, scratch=scratch)
    np.testing.assert_array_equal(pure.message, inplace.message)
    np.testing.assert_array_equal(work, pure.residual)
    one = np.zeros(100, np.float32)
    one[7] = 3.0
    enc = threshold_encode(one, 1.0, out=one, min_count=2)
    assert enc.format == 0 and enc.count == 0 and one[7] == 3.0
    assert not decode(enc.message).any()


@pytest.mark.parametrize("sparsity", [1e-3, 0.3])
def test_blockwise_scan_equals_one_block(monkeypatch, sparsity):
    # The scan runs block by block; hits on block edges and a short last block must give
    # the same message and residual as one scan over the whole vector.
    r = np.random.default_rng(2).normal(0, 1, 1000).astype(np.float32)
    t = float(np.quantile(np.abs(r), 1 - sparsity))
    r[[63, 64, 127, 128, 999]] = [2 * t, -3 * t, t, -t, 5 * t]
    whole = threshold_encode(r, t)
    monkeypatch.setattr(_encoding, "_BLOCK", 64)
    blocks = threshold_encode(r, t, scratch=encode_scratch(r.size))
    np.testing.assert_array_equal(blocks.message, whole.message)
    np.testing.assert_array_equal(blocks.residual, whole.residual)
    with pytest.raises(ValueError, match="scratch buffers must hold 64 elements"):
        threshold_encode(r, t, scratch=(np.empty(10, np.float32), np.empty(10, bool)))


def test_the_compiled_scan_is_used_when_numba_is_installed():
    pytest.importorskip("numba")  # the test extra installs it: CI runs the compiled scan
    assert _encoding.compiled_scan() is not None and _encoding._SCAN is _encoding.compiled_scan()


def test_importing_dlspark_loads_no_numba_until_a_gradient_sharing_job_encodes():
    # numba's import and the scan's load cost every process 0.4 s; only an encoding one needs them
    import subprocess
    import sys

    pytest.importorskip("numba")
    code = ("import sys, numpy as np, dlspark; from dlspark.algorithms.sharing import _encoding as e; "
            "print('numba' in sys.modules); e.threshold_encode(np.arange(200, dtype=np.float32), 50.0); "
            "print('numba' in sys.modules, e._SCAN is e.compiled_scan() is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "True"], out


def test_a_new_process_loads_the_compiled_scan_from_the_cache():
    # every worker process encodes; compiling the scan there again cost 0.36 s more than loading it
    import subprocess
    import sys

    pytest.importorskip("numba")
    code = ("import numpy as np; from dlspark.algorithms.sharing import _encoding as e; "
            "e.threshold_encode(np.arange(200, dtype=np.float32), 50.0); s = e._SCAN.stats; "
            "print(sum(s.cache_hits.values()), sum(s.cache_misses.values()))")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
            for _ in range(2)]
    assert runs[1] == ["1", "0"], runs  # the second process compiled nothing: the first left it on disk


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.integers(1, 700), elements=st.floats(-10, 10, width=32)), thresholds,
       st.sampled_from([64, 100, 1 << 19]))
def test_compiled_and_numpy_scans_give_the_same_message_and_residual(r, t, block):
    if _encoding.compiled_scan() is None:
        pytest.skip("numba is not installed: only the numpy scan exists")
    r[::97] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 10.0, -10.0, 1e-30][: r[::97].size]  # edge values, group edges
    old = _encoding._BLOCK
    try:
        _encoding._BLOCK = block
        compiled = threshold_encode(r, t, scratch=encode_scratch(r.size))
        scan, _encoding._SCAN = _encoding._SCAN, None
        try:
            plain = threshold_encode(r, t, scratch=encode_scratch(r.size))
        finally:
            _encoding._SCAN = scan
    finally:
        _encoding._BLOCK = old
    np.testing.assert_array_equal(compiled.message, plain.message)
    np.testing.assert_array_equal(compiled.residual, plain.residual)


pieces_st = st.lists(arrays(np.float32, st.integers(1, 200), elements=st.floats(-10, 10, width=32)), min_size=1,
                     max_size=4)


class _NoKnownThreshold:
    """A threshold algorithm without the optional ``known_threshold``: the separate passes."""

    def __init__(self, t):
        self.fixed = FixedThreshold(t)

    def prepare(self, state, residual):
        return self.fixed.prepare(state, residual)

    def update(self, state, sparsity):
        return self.fixed.update(state, sparsity)


@settings(max_examples=200, deadline=None)
@given(pieces_st, thresholds, st.sampled_from([64, 100, 1 << 19]), st.booleans())
def test_adding_and_finding_in_one_pass_has_the_bits_of_the_separate_passes(pieces, t, block, clip):
    # the worker's step: its update added to its residual (and copied, under the whole own
    # update), then encoded; the one compiled pass against add_pieces, a zeroed copy and the scan
    from dlspark.algorithms.sharing._state import add_and_encode

    if _encoding.compiled_scan() is None:
        pytest.skip("numba is not installed: only the separate passes exist")
    n = sum(p.size for p in pieces)
    pieces[0][::31] = [np.nan, -0.0, np.inf, 0.0, -np.inf, 1e-30, -10.0][: pieces[0][::31].size]
    residual = np.random.default_rng(n).normal(0, 2, n).astype(np.float32)
    post = ResidualClipping(2.0, 1) if clip else NoResidualPostProcessing()
    out = {}
    old = _encoding._BLOCK
    try:
        _encoding._BLOCK = block  # the scratch, and so each call's share of a piece, is this long
        for name, algo in (("fused", FixedThreshold(t)), ("separate", _NoKnownThreshold(t))):
            r, copy = residual.copy(), np.full(n, 7.0, np.float32)
            enc, r = add_and_encode(algo, post, algo.fixed.init() if name == "separate" else algo.init(), r,
                                    [p.copy() for p in pieces], encode_scratch(n), 1, keep_dropped=True, copy=copy)
            out[name] = (r, copy, enc.message, enc.dropped)
    finally:
        _encoding._BLOCK = old
    for fused, separate in zip(out["fused"], out["separate"]):
        if fused is None or separate is None:
            assert fused is separate
            continue
        np.testing.assert_array_equal(fused, separate)
        np.testing.assert_array_equal(np.signbit(fused), np.signbit(separate))  # +0.0 and -0.0 apart too


@pytest.mark.parametrize("at", [[0], [63], [64, 127], [130], [199]])
def test_one_pass_finds_a_lone_hit_at_a_groups_edge_and_in_the_tail(at):
    # the pass looks into a group of 64 only where some element of it crossed
    if _encoding.compiled_scan() is None:
        pytest.skip("numba is not installed: only the separate passes exist")
    residual, update = np.zeros(200, np.float32), np.zeros(200, np.float32)
    update[at] = 2.0
    hits = _encoding.add_and_find(residual, [update[:150], update[150:]], 1.0, encode_scratch(200))
    np.testing.assert_array_equal(hits, at)
    np.testing.assert_array_equal(residual, update)


def test_the_step_adds_and_finds_in_one_pass_once_the_threshold_is_known(monkeypatch):
    from dlspark.algorithms.sharing import _state

    if _encoding.compiled_scan() is None:
        pytest.skip("numba is not installed: only the separate passes exist")
    calls = []
    monkeypatch.setattr(_state, "add_and_find", lambda *a: calls.append(a) or _encoding.add_and_find(*a))
    algo, n = AdaptiveThreshold(warmup=2), 1000
    rng = np.random.default_rng(3)
    state, residual, scratch = algo.init(), np.zeros(n, np.float32), encode_scratch(n)
    assert algo.known_threshold(state) is None  # the warm-up reads the residual
    for step in range(1, 5):
        enc, residual = _state.add_and_encode(algo, NoResidualPostProcessing(), state, residual,
                                              [rng.normal(0, 1, n).astype(np.float32)], scratch, step)
        state = enc.tstate
        assert len(calls) == max(0, step - 2), step  # after the warm-up's two steps: the one pass
    assert algo.known_threshold(state) == state.threshold
    _state.add_and_encode(algo, NoResidualPostProcessing(), state, residual, [np.ones(n, np.float32)], scratch, 5,
                          density=0.01)  # a sparsity warm-up's threshold comes from the residual
    assert len(calls) == 2


def test_a_known_threshold_that_prepare_does_not_give_is_refused():
    from dlspark.algorithms.sharing._state import add_and_encode

    if _encoding.compiled_scan() is None:
        pytest.skip("numba is not installed: only the separate passes exist")

    class Inconsistent(_NoKnownThreshold):
        def known_threshold(self, state):
            return 2 * state.threshold

    algo = Inconsistent(0.5)
    with pytest.raises(RuntimeError, match="known_threshold gave 1.0 but prepare gave 0.5"):
        add_and_encode(algo, NoResidualPostProcessing(), algo.fixed.init(), np.zeros(10, np.float32),
                       [np.ones(10, np.float32)], encode_scratch(10), 1)
