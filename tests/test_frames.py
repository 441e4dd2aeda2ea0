"""DataFrames and Parquet files as training data, by column name."""

import os

import dask
import dask.dataframe as dd
import jax
import numpy as np
import optax
import pandas as pd
import pyarrow as pa
import pytest
from conftest import MLP, accuracy

import dlspark
from dlspark import DistributedTrainer, ParameterAveraging
from dlspark.data import SourceContext, fit_minibatches, frame_columns, keyed_rows, parquet_columns
from dlspark.evaluation import Evaluation

FEATURES = [f"x{i}" for i in range(64)]


def digits_frame(ds, npartitions=4):
    df = pd.DataFrame(np.asarray(ds.features), columns=FEATURES)
    df["label"] = np.asarray(ds.labels).argmax(1).astype(np.int64)
    return dd.from_pandas(df, npartitions=npartitions)


def _bad_frame():
    df = pd.DataFrame({"a": np.arange(4.0), "y": np.arange(4), "name": ["p", "q", "r", "s"]})
    df["ragged"] = pd.Series([[1.0], [1.0, 2.0], [], [3.0]], dtype=pd.ArrowDtype(pa.list_(pa.float32())))
    df["fixed"] = pd.Series([[1.0, 2.0]] * 4, dtype=pd.ArrowDtype(pa.list_(pa.float32(), 2)))
    return dd.from_pandas(df, npartitions=2)


# -- checked against the schema, before any cluster work ------------------------------------
def test_a_missing_column_is_named_with_the_frame_columns():
    with pytest.raises(ValueError, match=r"feature column 'b' is not in the frame; its columns are \['a', 'y', "):
        frame_columns(_bad_frame(), ["a", "b"], "y")
    with pytest.raises(ValueError, match="label column 'label' is not in the frame"):
        frame_columns(_bad_frame(), ["a"], ["label"])


def test_a_non_numeric_column_is_named_with_what_is_allowed():
    with pytest.raises(TypeError, match=r"feature column 'name' has dtype .*str.*, which is not numeric; allowed "
                                        r"are numeric columns \(bool, integer, float\), pyarrow fixed-size lists"):
        frame_columns(_bad_frame(), ["a", "name"], "y")


def test_a_ragged_array_column_is_refused_with_the_fixed_size_form():
    with pytest.raises(ValueError, match=r"feature column 'ragged' holds lists of varying length \(list<item: float>\)"
                                         r".*allowed are fixed-size lists"):
        frame_columns(_bad_frame(), ["a", "ragged"], "y")
    cols = frame_columns(_bad_frame(), ["a", "fixed"], "y")  # fixed-size: three features an example
    assert [(c.name, c.width) for c in cols.features] == [("a", 0), ("fixed", 2)]


def test_an_empty_frame_is_refused(digits):
    empty = pd.DataFrame({"a": np.zeros(0), "y": np.zeros(0, np.int64)})
    with pytest.raises(ValueError, match=r"the frame has no rows \(columns \['a', 'y'\]\)"):
        frame_columns(empty, "a", "y")
    # a dask frame: refused by frame_columns, before any fit; dask's metadata knows a pandas-backed
    # frame's partition lengths, so nothing is computed
    refused = (r"the dask DataFrame 'frompandas-\w+' has no rows in any of its 2 partitions \(columns \['a', 'y'\]\): "
               r"training and evaluation need")
    with dask.config.set(scheduler=_refuse_compute), pytest.raises(ValueError, match=refused):
        frame_columns(dd.from_pandas(empty, npartitions=2), "a", "y")
    # a generated frame (no lengths in its metadata): the first partition is counted, and only when
    # it is empty every partition; a frame whose rows come later is taken
    meta = pd.DataFrame({"a": np.zeros(0), "y": np.zeros(0, np.int64)})
    _CALLS.clear()
    with dask.config.set(scheduler="sync"):
        frame_columns(dd.from_map(_rows, [3, 0, 0], meta=meta), "a", "y")
        assert _CALLS == [3]
        _CALLS.clear()
        frame_columns(dd.from_map(_rows, [0, 0, 2], meta=meta), "a", "y")
        assert sorted(_CALLS) == [0, 0, 0, 2]  # the first counted alone, then all
        with pytest.raises(ValueError, match=r"the dask DataFrame '[\w-]+' has no rows in any of its 3"):
            frame_columns(dd.from_map(_rows, [0, 0, 0], meta=meta), "a", "y")


_CALLS = []


def _rows(n):
    _CALLS.append(n)
    return pd.DataFrame({"a": np.zeros(n), "y": np.zeros(n, np.int64)})


def _refuse_compute(dsk, keys, **kwargs):
    raise AssertionError(f"computed {keys}")


def test_a_bare_dask_frame_gets_the_call_that_names_its_columns():
    with pytest.raises(TypeError, match=r"a dask DataFrame needs its columns named: fit\(ddf, features="):
        fit_minibatches(_bad_frame(), SourceContext())


def test_columns_become_examples_and_class_ids(digits):
    tr, _ = digits
    cols = frame_columns(digits_frame(tr[:100], 2), FEATURES, "label")
    from dlspark.data._frames import frame_arrays

    x, y = frame_arrays(cols.frame.compute(), cols.features, cols.labels)
    np.testing.assert_array_equal(x, np.asarray(tr.features[:100], np.float32))
    assert y.dtype == np.int32 and y.tolist() == np.asarray(tr.labels[:100]).argmax(1).tolist()
    x2, y2 = frame_arrays(_bad_frame().compute(), frame_columns(_bad_frame(), ["fixed", "a"], None).features, None)
    assert x2.shape == (4, 3) and y2 is None and x2[2].tolist() == [1.0, 2.0, 2.0]


def test_a_local_fit_from_a_frame_one_partition_at_a_time(digits, make_net):
    tr, te = digits
    net = make_net()
    net.fit(frame_columns(digits_frame(tr), FEATURES, "label"), epochs=3, batch_size=32)
    assert accuracy(net, te) >= 0.9


# -- on the shared two-worker cluster -------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)  # a fit, an evaluation and inference on two workers
def test_fit_evaluate_and_keyed_inference_from_a_dask_frame(client2, make_net, digits, tmp_path):
    tr, te = digits
    # a weight column reaches the minibatches the workers cut as their labels mask
    # (what the loss weighs by: test_rows_of_weight_zero_have_no_effect)
    ids = np.asarray(tr.labels[:200]).argmax(1)
    cut = fit_minibatches(frame_columns(_weighted_frame(tr[:200], (ids % 3).astype(np.float32)), FEATURES, "label",
                                        weight="w"),
                          SourceContext(client2, 32, "export", export_dir=lambda: str(tmp_path / "weighted")))
    batches = [dlspark.data.load_minibatch(r) for r in cut.refs]
    assert sum(len(b) for b in batches) == 200
    assert all(b.labels_mask.tolist() == (b.labels % 3).astype(float).tolist() for b in batches)
    net = make_net(MLP(hidden=128), updater=optax.adam(1e-2))
    trainer = DistributedTrainer(client2, net, ParameterAveraging(batch_size_per_worker=32, averaging_frequency=4),
                                 progress=False)
    trainer.fit(digits_frame(tr), epochs=4, features=FEATURES, labels="label")
    assert accuracy(net, te) >= 0.9
    test_frame = digits_frame(te, 3)
    ev = trainer.evaluate(test_frame, features=FEATURES, labels=["label"])
    local = Evaluation()
    local.update(np.asarray(te.labels), net.output(te.features))
    assert ev.count == len(te) and ev.confusion_matrix().tolist() == local.confusion_matrix().tolist()
    # keyed inference: the frame's index keys the outputs
    shuffled = test_frame.sample(frac=1.0, random_state=0)
    out = dict(trainer.predict_with_keys(keyed_rows(shuffled, FEATURES)).compute())
    assert sorted(out) == list(range(len(te)))
    want = net.output(te.features)
    np.testing.assert_allclose(np.stack([out[i] for i in range(len(te))]), want, rtol=1e-5, atol=1e-5)
    # scoring: a lazy dask Series, each partition scored where it lives; computing it sends the
    # client the losses (a few bytes a row), never a partition's features
    scores = trainer.score_examples(shuffled, features=FEATURES, labels="label")
    assert dask.is_dask_collection(scores) and scores.npartitions == shuffled.npartitions
    before = _sent_to_non_workers(client2)
    got = scores.compute()
    sent = _sent_to_non_workers(client2) - before
    part_bytes = len(te) // 3 * len(FEATURES) * 4
    assert 0 < sent < part_bytes / 4, f"{sent} bytes left the workers for the client; a partition is {part_bytes}"
    np.testing.assert_allclose(got.sort_index().to_numpy(), net.score_examples(te), rtol=1e-4, atol=1e-6)
    assert trainer.calculate_score(shuffled, features=FEATURES, labels="label") == pytest.approx(
        float(net.score_examples(te).mean()), rel=1e-4)
    trainer.close()


def _sent_to_non_workers(client):
    """Bytes the workers have sent (Dask's get_data, logged in each worker's transfer_outgoing_log)
    to anything that is not a worker: the client, or the scheduler gathering for it."""
    workers = set(client.scheduler_info()["workers"])
    logs = client.run(lambda dask_worker: [(e["who"], e["total"]) for e in dask_worker.transfer_outgoing_log])
    return sum(total for log in logs.values() for who, total in log if who not in workers)


@pytest.mark.slow
@pytest.mark.timeout(600)  # a fit, an evaluation and inference on two workers
def test_parquet_on_s3_trains_and_evaluates_from_the_workers(client2, make_net, digits):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server._server.server_address
        opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": f"http://{host}:{port}",
                                                                          "region_name": "us-east-1"}}
        import boto3

        boto3.client("s3", aws_access_key_id="testing", aws_secret_access_key="testing",
                     **opts["client_kwargs"]).create_bucket(Bucket="dlspark-pq")
        tr, te = digits
        # 5 files, each of several row groups: minibatches are cut across a file's row groups
        digits_frame(tr, 5).to_parquet("s3://dlspark-pq/train", storage_options=opts, write_index=False,
                                       row_group_size=100)
        digits_frame(te, 2).to_parquet("s3://dlspark-pq/test", storage_options=opts, write_index=False)
        net = make_net(MLP(hidden=128), updater=optax.adam(1e-2))
        trainer = DistributedTrainer(client2, net, ParameterAveraging(batch_size_per_worker=32, averaging_frequency=4),
                                     progress=False)
        trainer.fit_paths("s3://dlspark-pq/train/*.parquet", epochs=4, features=FEATURES, labels="label",
                          storage_options=opts)
        assert accuracy(net, te) >= 0.9
        ev = trainer.evaluate(parquet_columns("s3://dlspark-pq/test/*.parquet", FEATURES, "label", opts))
        assert ev.count == len(te) and ev.accuracy() == pytest.approx(accuracy(net, te))
        with pytest.raises(ValueError, match="label column 'lbl' is not in the frame; its columns are"):
            trainer.fit_paths("s3://dlspark-pq/train/*.parquet", features=FEATURES, labels="lbl", storage_options=opts)
        trainer.close()
    finally:
        server.stop()


def _generated_partition(i, rows, width):
    rng = np.random.default_rng(i)
    x = rng.normal(size=(rows, width)).astype(np.float32)
    df = pd.DataFrame(x, columns=[f"f{j}" for j in range(width)])
    df["y"] = (x[:, 0] > 0).astype(np.int64)
    return df


def _rss():
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


@pytest.mark.slow
def test_a_frame_generated_on_the_workers_never_reaches_the_client(client2, digits):
    # 8 partitions of 8192 rows x 512 float32 columns, 16 MiB each (128 MiB in all): a size that
    # fits a shared 2-core test machine (benchmarks/bench_frames.py runs the 64 MiB partitions of
    # the acceptance); the client's resident memory must grow by less than 1.5 partitions over the fit.
    import jax.numpy as jnp

    rows, width = 8192, 512
    part_bytes = rows * width * 4
    meta = _generated_partition(0, 0, width)
    ddf = dd.from_map(_generated_partition, list(range(8)), rows=rows, width=width, meta=meta)
    cols = [f"f{j}" for j in range(width)]

    def init(rng, x):
        return {"w": jnp.zeros((x.shape[-1], 2))}

    def apply(v, x, train, rng):
        return x @ v["w"]

    net = dlspark.Network(dlspark.Model(init, apply, np.zeros((1, width), np.float32)), updater=optax.sgd(0.01))
    trainer = DistributedTrainer(client2, net, ParameterAveraging(batch_size_per_worker=512, averaging_frequency=4),
                                 progress=False)
    small = dd.from_map(_generated_partition, [100, 101], rows=64, width=width, meta=meta)
    trainer.fit(small, features=cols, labels="y")  # the same path once, warm (imports, compiled programs)
    before, sent_before = _rss(), _sent_to_non_workers(client2)
    trainer.fit(ddf, features=cols, labels="y")
    grew = _rss() - before
    sent = _sent_to_non_workers(client2) - sent_before
    assert net.iteration > 128
    assert grew < 1.5 * part_bytes, f"the client grew by {grew / 2**20:.1f} MiB, a partition is {part_bytes / 2**20} MiB"
    # the workers' transfer logs: what left them for the client (or the scheduler gathering for
    # it) over the fit is far less than one partition
    assert sent < part_bytes / 16, f"{sent} bytes left the workers for the client; a partition is {part_bytes}"
    trainer.close()
    assert dask.is_dask_collection(ddf)


# -- sample weights ---------------------------------------------------------------------------
def _weighted_frame(tr, weights, npartitions=3):
    ddf = digits_frame(tr, npartitions)
    return ddf.assign(w=dd.from_pandas(pd.Series(weights, dtype=np.float32), npartitions=npartitions))


def test_rows_of_weight_zero_have_no_effect(digits, make_net):
    tr, te = digits
    n = len(tr) - len(tr) % 32
    tr = tr[:n]
    # every odd row at weight 0, every even row at 2: each minibatch of 32 holds 16 rows that count,
    # the same 16 that a minibatch of 16 holds once those rows are dropped, and the loss is their
    # weighted mean, so both fits take the same steps (plain SGD: a scaled loss would show)
    w = np.tile(np.float32([2.0, 0.0]), n // 2)
    # (the weights ignored, or the loss a plain sum over the kept rows, the steps would differ)
    weighted, dropped = (make_net(updater=optax.sgd(0.05)) for _ in range(2))
    # one partition: full minibatches only (one compiled shape a fit)
    weighted.fit(frame_columns(_weighted_frame(tr, w, 1), FEATURES, "label", weight="w"), epochs=2, batch_size=32)
    dropped.fit(frame_columns(digits_frame(tr[::2], 1), FEATURES, "label"), epochs=2, batch_size=16)
    assert weighted.iteration == dropped.iteration == 2 * n // 32
    for a, b in zip(jax.tree_util.tree_leaves(weighted.params), jax.tree_util.tree_leaves(dropped.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    # a class at weight 0 is not learnt; the others are
    ids = np.asarray(tr.labels).argmax(1)
    no3 = make_net()
    no3.fit(frame_columns(_weighted_frame(tr, (ids != 3).astype(np.float32), 1), FEATURES, "label", weight="w"),
            epochs=3, batch_size=32)
    pred, truth = np.asarray(no3.output(te.features)).argmax(1), np.asarray(te.labels).argmax(1)
    assert (pred[truth == 3] == 3).mean() < 0.1 and (pred == truth)[truth != 3].mean() >= 0.85


def test_a_bad_weight_column_is_named():
    with pytest.raises(TypeError, match=r"weight column 'fixed' must hold one number a row"):
        frame_columns(_bad_frame(), ["a"], "y", weight="fixed")
    with pytest.raises(ValueError, match=r"weight column 'v' is not in the frame"):
        frame_columns(_bad_frame(), ["a"], "y", weight="v")
    from dlspark.data._frames import frame_weights

    cols = frame_columns(_bad_frame().assign(a=-1.0), ["y"], "y", weight="a")
    with pytest.raises(ValueError, match=r"weight column 'a' holds -1.0: sample weights must be non-negative"):
        frame_weights(cols.frame.compute(), cols.weight)
