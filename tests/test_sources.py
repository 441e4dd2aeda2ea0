"""The data-source registry, the one minibatch-reference resolver, and the worker network cache."""

import threading

import dask
import jax
import numpy as np
import pytest

from dlspark import _netcache
from dlspark.data import (DataSet, Minibatches, Source, SourceContext, evaluation_parts, fit_minibatches, load_minibatch,
                          load_ref, path_minibatches, register_source, save_dataset, unregister_source)
from dlspark.data._sources import keyed_items, local_batches, reject_memory


def _data(n=10):
    rng = np.random.default_rng(0)
    return DataSet(rng.normal(size=(n, 3)).astype(np.float32), rng.integers(0, 2, (n, 2)).astype(np.float32))


def _export_ctx(tmp_path, batch_size=4):
    dirs = iter(range(100))
    return SourceContext(None, batch_size, "export", lambda: str(tmp_path / f"export{next(dirs)}"))


class Columns(Source):
    """A new kind of input: a dict of feature and label columns."""

    description = "a dict of 'x' and 'y' columns"

    def accepts(self, data):
        return isinstance(data, dict) and set(data) == {"x", "y"}

    def fit_refs(self, data, ctx):
        return fit_minibatches(DataSet(data["x"], data["y"]), ctx)

    def eval_parts(self, data, ctx, n_parts):
        return "refs", [[DataSet(data["x"], data["y"])]]


class Claims(Source):
    """Claims every DataSet for fit, ahead of the built-in source."""

    description = "a claimed DataSet"

    def accepts(self, data):
        return isinstance(data, DataSet)

    def fit_refs(self, data, ctx):
        return Minibatches(["claimed"], [0])


@pytest.fixture
def registered():
    added = []

    def add(source, first=True):
        added.append(register_source(source, first))
        return source

    yield add
    for s in added:
        unregister_source(s)


# -- the registry --------------------------------------------------------------------------
def test_a_source_registered_first_serves_fit_and_evaluation(registered, tmp_path):
    ds = _data(10)
    registered(Columns())
    m = fit_minibatches({"x": ds.features, "y": ds.labels}, _export_ctx(tmp_path))
    assert [u.rsplit("/", 1)[1] for u in m.refs] == ["batch_000000.npz", "batch_000001.npz", "batch_000002.npz"]
    assert m.partitions == [0, 0, 0] and m.keep is None
    back = DataSet.merge([load_minibatch(u) for u in m.refs])
    np.testing.assert_array_equal(back.features, ds.features)
    kind, parts = evaluation_parts({"x": ds.features, "y": ds.labels}, SourceContext(), 4)
    assert kind == "refs" and len(parts[0][0]) == 10


def test_first_registered_source_wins_and_unregistering_restores_the_built_in(tmp_path):
    ds = _data(8)
    claims = register_source(Claims())
    try:
        assert fit_minibatches(ds, _export_ctx(tmp_path)).refs == ["claimed"]
    finally:
        unregister_source(claims)
    assert len(fit_minibatches(ds, _export_ctx(tmp_path)).refs) == 2
    register_source(claims, first=False)  # behind the built-ins, it is never reached for a DataSet
    try:
        assert fit_minibatches(ds, _export_ctx(tmp_path)).refs != ["claimed"]
    finally:
        unregister_source(claims)
    with pytest.raises(ValueError, match="is not registered"):
        unregister_source(claims)
    with pytest.raises(TypeError, match="Source subclass, got dict"):
        register_source({"accepts": len})


def test_unknown_input_names_its_type_and_lists_what_is_accepted(registered, tmp_path):
    registered(Columns())
    with pytest.raises(TypeError, match=r"fit takes .*a dict of 'x' and 'y' columns.*a pair of dask arrays.*"
                                        r"a list of DataSets.*; got float.*use fit_paths"):
        fit_minibatches(3.5, _export_ctx(tmp_path))
    with pytest.raises(TypeError, match=r"evaluation takes .*minibatch file URLs.*; got set"):
        evaluation_parts({1, 2}, SourceContext(), 2)
    with pytest.raises(TypeError, match=r"fit takes .*an iterator of minibatches.*; got int"):
        local_batches(3, 32, 1)
    with pytest.raises(TypeError, match="a list given to fit must hold DataSets .*found str"):
        fit_minibatches(["a.npz"], _export_ctx(tmp_path))
    with pytest.raises(TypeError, match="a list given to fit must hold DataSets.*found nothing"):
        fit_minibatches([], _export_ctx(tmp_path))


def test_local_batches_keep_the_local_fit_rules(tmp_path):
    ds = _data(10)
    batches, are_urls = local_batches(ds, 4, 3)
    assert [len(b) for b in batches] == [4, 4, 2] and not are_urls
    assert local_batches((ds.features, ds.labels), 5, 1)[0][1].num_examples == 5
    assert local_batches(batches, 99, 2) == (batches, False)
    urls = [save_dataset(b, str(tmp_path / f"b{i}.npz")) for i, b in enumerate(batches)]
    assert local_batches(urls, 99, 2) == (urls, True)
    assert local_batches(str(tmp_path / "*.npz"), 99, 2) == (sorted(urls), True)
    it = iter(batches)
    assert local_batches(it, 4, 1) == (it, False)
    with pytest.raises(ValueError, match="can be consumed once: pass epochs=1"):
        local_batches(iter(batches), 4, 2)
    with pytest.raises(TypeError, match=r"must hold DataSets \(minibatches\) or file URLs, found int"):
        local_batches([batches[0], 3], 4, 1)


def test_an_export_writes_its_files_a_few_at_a_time_in_example_order(tmp_path):
    from dlspark.data._sources import _EXPORT_THREADS, _save_all

    x = np.arange(103 * 3, dtype=np.float32).reshape(103, 3)
    y = np.eye(2, dtype=np.float32)[np.arange(103) % 2]
    writers = set()
    import dlspark.data._sources as sources

    real = sources.save_dataset

    def spy(*args, **kw):
        writers.add(threading.current_thread().name)
        return real(*args, **kw)

    sources.save_dataset = spy
    try:
        urls = _save_all(DataSet(x, y).batches(5), str(tmp_path), "part")
    finally:
        sources.save_dataset = real
    assert [u.rsplit("/", 1)[1] for u in urls] == [f"part_{i:06d}.npz" for i in range(21)]
    back = [load_minibatch(u) for u in urls]
    np.testing.assert_array_equal(np.concatenate([b.features for b in back]), x)
    assert 1 < len(writers) <= _EXPORT_THREADS
    with pytest.raises(TypeError, match="DataSet"):  # the first failed write is raised
        _save_all([DataSet(x[:5], y[:5]), "not a minibatch"], str(tmp_path / "bad"), "part")


def test_context_and_result_reject_bad_values_by_name():
    with pytest.raises(ValueError, match="training_approach must be one of .*got 'copy'"):
        SourceContext(None, 32, "copy")
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        SourceContext(None, 0)
    with pytest.raises(TypeError, match="export_dir must be a callable or None, got str"):
        SourceContext(None, 32, "export", "/tmp/x")
    with pytest.raises(ValueError, match="needs SourceContext\\(export_dir=...\\)"):
        fit_minibatches(_data(4), SourceContext(None, 2, "export"))
    with pytest.raises(ValueError, match="one entry per minibatch, got 2 refs and 1 partitions"):
        Minibatches(["a", "b"], [0])


# -- URLs ------------------------------------------------------------------------------------
def test_memory_urls_are_refused_by_name():
    with pytest.raises(ValueError, match="path 'memory://x/\\*.npz' is on memory://.*cannot be read by worker processes"):
        path_minibatches("memory://x/*.npz")
    with pytest.raises(ValueError, match="path 'memory://y/b.npz' is on memory://"):
        path_minibatches(["/tmp/a.npz", "memory://y/b.npz"])
    with pytest.raises(ValueError, match="memory://.*cannot be read by worker processes"):
        evaluation_parts("memory://x/*.npz", SourceContext(), 2)
    with pytest.raises(ValueError, match="export_directory 'memory://e' is on memory://"):
        reject_memory("memory://e", "export_directory")
    reject_memory("s3://bucket/e", "export_directory")


def test_paths_and_evaluation_parts_of_files(tmp_path):
    urls = [save_dataset(b, (tmp_path / "mb" / f"batch_{i:06d}.npz").as_uri()) for i, b in enumerate(_data(10).batches(2))]
    listed = path_minibatches((tmp_path / "mb").as_uri())
    assert listed == urls
    kind, parts = evaluation_parts(str(tmp_path / "mb" / "*.npz"), SourceContext(), 2)
    assert kind == "refs" and [len(p) for p in parts] == [3, 2]
    assert sorted(u for p in parts for u in p) == sorted(str(tmp_path / "mb" / f"batch_{i:06d}.npz") for i in range(5))


# -- keyed inputs ------------------------------------------------------------------------------
def test_keyed_items_recognise_dicts_lists_and_bags_and_refuse_duplicate_keys():
    import dask.bag as db

    x = np.zeros(3)
    assert keyed_items({"a": x}) == ("dict", [("a", x)])
    assert keyed_items([("a", x), ("b", x)])[0] == "list"
    assert keyed_items(db.from_sequence([("a", x)]))[0] == "bag"
    assert keyed_items(x) is None and keyed_items([1, 2]) is None
    with pytest.raises(ValueError, match="duplicate key 'a' in keyed features; keys must be unique"):
        keyed_items([("a", x), ("b", x), ("a", x)])
    ds = _data(2)
    assert keyed_items([("e0", ds)], of="examples")[0] == "list"
    # for scoring, a list of (features, labels) arrays is examples, not keyed input
    assert keyed_items([(x, x)], of="examples") is None
    with pytest.raises(ValueError, match="duplicate key 'e0' in keyed examples"):
        keyed_items([("e0", ds), ("e0", ds)], of="examples")


# -- load_ref ----------------------------------------------------------------------------------
def test_load_ref_reads_urls_with_and_without_a_loader(tmp_path):
    ds = _data(6)
    url = save_dataset(ds, (tmp_path / "one.npz").as_uri())
    np.testing.assert_array_equal(load_ref(url).features, ds.features)
    np.testing.assert_array_equal(load_ref(url, storage_options={"auto_mkdir": False}).labels, ds.labels)
    # a foreign format, read by a loader: features and labels as CSV columns
    csv = tmp_path / "one.csv"
    np.savetxt(csv, np.hstack([ds.features, ds.labels]), delimiter=",")

    def csv_loader(u):
        import fsspec

        with fsspec.open(u, "r") as f:
            a = np.loadtxt(f, delimiter=",", dtype=np.float32)
        return DataSet(a[:, :3], a[:, 3:])

    got = load_ref(csv.as_uri(), loader=csv_loader)
    np.testing.assert_allclose(got.features, ds.features, rtol=1e-6)
    with pytest.raises(TypeError, match="the loader's result for '.*one.csv' must be a DataSet"):
        load_ref(csv.as_uri(), loader=lambda u: [1, 2])
    assert load_ref(ds) is ds
    assert len(load_ref((ds.features, ds.labels))) == 6
    with pytest.raises(ValueError, match="names data in a Dask worker's memory; pass worker="):
        load_ref(("some-key", 0))
    with pytest.raises(TypeError, match="a minibatch reference must be .*got int"):
        load_ref(3)


def _load_key_on_worker(key, index):
    from distributed import get_worker

    w = get_worker()
    had = key in w.data
    return had, len(load_ref((key, index), worker=w))


@pytest.mark.slow
def test_direct_refs_are_replicated_and_load_ref_fetches_a_key_from_a_peer(client2):
    ds = _data(10)
    m = fit_minibatches(ds, SourceContext(client2, 4, "direct"))
    assert m.partitions == [0, 0, 0] and [i for _, i in m.refs] == [None, None, None]
    assert all(len(holders) == 2 for holders in client2.who_has(m.keep).values())
    a, b = sorted(client2.scheduler_info()["workers"])
    [held] = client2.scatter([ds.batches(3)], workers=[a], hash=False)
    had, n = client2.submit(_load_key_on_worker, held.key, 3, workers=[b], pure=False).result()
    assert (had, n) == (False, 1)  # the last minibatch of 10 in threes, fetched from the peer
    assert client2.submit(_load_key_on_worker, held.key, 0, workers=[a], pure=False).result() == (True, 3)


# -- the worker network cache ------------------------------------------------------------------
@pytest.fixture
def definition(make_net):
    _netcache.clear()
    yield make_net().definition()
    _netcache.clear()


def test_network_cache_evicts_the_oldest_beyond_its_size(definition):
    with dask.config.set({"dlspark.worker.network-cache-size": 1}):
        a = _netcache.cached_network(definition, "a")
        assert _netcache.cached_network(definition, "a") is a
        b = _netcache.cached_network(definition, "b")
        assert b is not a and _netcache.cached_network(definition, "b") is b
        assert _netcache.cached_network(definition, "a") is not a  # "a" was evicted by "b"
    with dask.config.set({"dlspark.worker.network-cache-size": 2}):
        _netcache.clear()
        a, b = (_netcache.cached_network(definition, t) for t in "ab")
        assert _netcache.cached_network(definition, "a") is a  # used last: "b" is now the oldest
        _netcache.cached_network(definition, "c")
        assert _netcache.cached_network(definition, "a") is a
        assert _netcache.cached_network(definition, "b") is not b
    with dask.config.set({"dlspark.worker.network-cache-size": 0}):
        with pytest.raises(ValueError, match="network-cache-size must be an integer >= 1, got 0"):
            _netcache.cached_network(definition, "z")


def test_one_network_per_token_across_threads(definition):
    got, barrier = [], threading.Barrier(8)

    def build():
        barrier.wait()
        got.append(_netcache.cached_network(definition, "shared"))

    threads = [threading.Thread(target=build) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(n) for n in got}) == 1 and got[0]._steps is not None


def test_state_versions_are_cached_per_network_and_bounded(definition, make_net):
    from dlspark.checkpoint import state_to_arrays

    raw = state_to_arrays(_netcache.inference_part(make_net(seed=3).state))
    assert len(raw["arrays"]) == len(jax.tree_util.tree_leaves(make_net().state.params))  # no updater state
    with dask.config.set({"dlspark.worker.state-cache-size": 2}):
        v1 = _netcache.network_at(definition, "n", "v1", raw)
        assert _netcache.network_at(definition, "n", "v1", raw).state is v1.state
        v2 = _netcache.network_at(definition, "n", "v2", raw)
        _netcache.network_at(definition, "n", "v3", raw)  # evicts v1, the oldest
        assert _netcache.network_at(definition, "n", "v2", raw).state is v2.state
        assert _netcache.network_at(definition, "n", "v1", raw).state is not v1.state
    # views share the one network's compiled steps, and never its state
    net = _netcache.cached_network(definition, "n")
    assert v1.steps is net.steps and v1 is not net
    x = np.random.default_rng(1).random((2, 64)).astype(np.float32)
    np.testing.assert_allclose(v1.output(x), make_net(seed=3).output(x), rtol=1e-6)
    assert not np.allclose(net.output(x), v1.output(x))


def test_a_worker_rebuilds_what_inference_reads_from_the_blob(make_net, digits):
    # Inference, evaluation and scoring read the parameters and the model state (here a
    # batch norm's running statistics), never the updater's: the blob carries those two.
    import cloudpickle
    from conftest import BNNet

    from dlspark._inference import _network, network_blob

    tr, _ = digits
    net = make_net(BNNet())
    net.fit(tr[:256], batch_size=64)
    _netcache.clear()
    try:
        blob = network_blob(net, "v1")
        shipped = cloudpickle.loads(blob)["state"]
        assert len(shipped["arrays"]) == len(jax.tree_util.tree_leaves((net.state.params, net.state.model_state)))
        view = _network(blob)
        for a, b in zip(jax.tree_util.tree_leaves(view.state.model_state), jax.tree_util.tree_leaves(net.state.model_state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(view.output(tr.features[:32]), net.output(tr.features[:32]))
        assert view.score(tr[:64]) == pytest.approx(net.score(tr[:64]), rel=1e-6)
    finally:
        _netcache.clear()
