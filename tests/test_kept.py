"""The states a worker keeps from its last fits (dlspark.distributed._kept): a thinned state
leaves out exactly the arrays the worker holds bit for bit, and is filled back whole."""

import dask
import numpy as np
import pytest

from dlspark.distributed._kept import (KeptStates, continuing, digests, pull_arrays, put_arrays, sent_bytes,
                                      state_digests, thin)


def _state(seed=0):
    rng = np.random.default_rng(seed)
    return {"leaves": ["described"], "arrays": [rng.normal(size=(3, 4)).astype(np.float32),
                                                 np.arange(5, dtype=np.int32), np.float32(rng.normal(size=()))]}


def test_a_thinned_state_is_filled_back_bit_for_bit_from_what_was_kept():
    kept = KeptStates()
    old = _state()
    theirs = kept.keep("fit-1", old)
    new = _state()
    new["arrays"][0] = new["arrays"][0].copy()
    new["arrays"][0][1, 2] = np.nextafter(new["arrays"][0][1, 2], np.float32(9))  # one ulp apart
    thinned = thin(new, state_digests(new), "fit-1", theirs)
    assert [a is None for a in thinned["arrays"]] == [False, True, True]
    assert sent_bytes(thinned) == new["arrays"][0].nbytes
    whole = kept.fill(thinned)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(whole["arrays"], new["arrays"]))
    # the filled arrays are copies: the job may donate them without touching what is kept
    whole["arrays"][1][:] = -1
    assert kept.fill(thinned)["arrays"][1].tolist() == [0, 1, 2, 3, 4]


def test_a_replica_that_goes_on_keeps_its_own_arrays_only_when_the_state_is_the_last_fits_end():
    # Two workers kept different states at the end of a fit (gradient sharing: each its own
    # updater state); the client's state is the first one's. Each takes the arrays named
    # "own" from what it kept, whatever their digests, and only while the client's state is
    # bit for bit one of those kept: a changed state is sent as it is.
    kept_a, kept_b = KeptStates(), KeptStates()
    a, b = _state(0), _state(0)
    b["arrays"][0] = b["arrays"][0] + 1  # worker b's own array 0 (an updater state, say)
    kept = {"a": ("fit-1", kept_a.keep("fit-1", a, extra={"residual": 1})),
            "b": ("fit-1", kept_b.keep("fit-1", b, extra={"residual": 2}))}
    mine = state_digests(a)
    assert continuing(mine, kept)
    thinned = thin(a, mine, *kept["b"], own=frozenset({0}))
    assert thinned["continue"] and sent_bytes(thinned) == 0
    assert np.array_equal(kept_b.fill(thinned)["arrays"][0], b["arrays"][0])  # b's own, not the client's
    assert kept_b.extra("fit-1") == {"residual": 2} and kept_b.extra("fit-0") is None
    changed = _state(0)
    changed["arrays"][2] = np.float32(changed["arrays"][2] + 1)
    assert not continuing(state_digests(changed), kept)
    plain = thin(changed, state_digests(changed), *kept["b"])
    assert "continue" not in plain and plain["arrays"][0] is not None


def test_same_bytes_of_another_shape_or_dtype_are_not_taken():
    a = np.arange(6, dtype=np.float32)
    assert len(set(digests([a, a.reshape(2, 3), a.view(np.int32)]))) == 3


def test_a_state_not_kept_is_asked_for_whole_and_the_oldest_makes_way():
    kept = KeptStates()
    with dask.config.set({"dlspark.worker.kept-states": 2}):
        for key in ("fit-1", "fit-2", "fit-3"):
            d = kept.keep(key, _state())
    s = _state()
    assert kept.fill(thin(s, d, "fit-1", d)) is None  # made way for newer ones
    assert kept.fill(thin(s, d, "fit-3", d)) is not None
    assert kept.fill(s) is s  # a whole state is taken as it is
    with dask.config.set({"dlspark.worker.kept-states": 0}):
        assert kept.keep("fit-4", s) is None
    with dask.config.set({"dlspark.worker.kept-states": -1}), pytest.raises(ValueError, match="kept-states"):
        kept.keep("fit-5", s)


def test_what_the_algorithm_carries_leaves_the_spec_and_comes_back_thinned_alike():
    momentum = np.ones((16, 32), np.float32)
    carried = {"outer_state": ({"trace": momentum, "small": np.zeros(3, np.float32)}, None), "threshold": 0.1}
    pulled, arrays = pull_arrays(carried)
    assert len(arrays) == 1 and np.array_equal(arrays[0], momentum)
    assert pulled["outer_state"][0]["small"].shape == (3,) and pulled["threshold"] == 0.1  # small ones stay
    kept = KeptStates()
    s = {**_state(), "carried": arrays}
    theirs = kept.keep("fit-1", s)
    thinned = thin(s, state_digests(s), "fit-1", theirs)
    assert sent_bytes(thinned) == 0 and thinned["carried"] == [None]
    back = put_arrays(pulled, kept.fill(thinned)["carried"])
    assert np.array_equal(back["outer_state"][0]["trace"], momentum) and back["outer_state"][1] is None


def test_a_state_held_by_several_replicas_is_fetched_from_all_of_them_only_where_their_bits_agree():
    from dlspark.distributed._client import split_fetch

    def kept(*digest_lists):
        return {w: ("job", {"arrays": d, "carried": []}) for w, d in zip("abc", digest_lists)}

    sizes = [400, 800, 800, 8]  # params 0 and 3; an updater's two moments 1 and 2
    # every array the same everywhere: the bytes are spread, the largest first
    plan = split_fetch(kept(list("pmnq"), list("pmnq")), "ab", sizes, params=(0, 3))
    assert plan == {"a": [0, 1], "b": [2, 3]}
    # the moments differ (gradient sharing's own updaters): they come from the source alone
    plan = split_fetch(kept(list("pmnq"), list("pMNq")), "ab", sizes, params=(0, 3))
    assert plan == {"a": [1, 2], "b": [0, 3]}
    # parameters that differ anywhere, a replica without digests, or one holder: the whole
    # state from the source, as before (no plan)
    assert split_fetch(kept(list("pmnq"), list("Pmnq")), "ab", sizes, params=(0, 3)) is None
    assert split_fetch(kept(list("pmnq")), "ab", sizes, params=(0, 3)) is None
    assert split_fetch(kept(list("pmnq")), "a", sizes) is None
