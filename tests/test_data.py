import io
import zipfile

import fsspec
import numpy as np
import pytest

from dlspark.data import DataSet, MultiDataSet, list_minibatches, load_minibatch, save_dataset, save_minibatches
from dlspark.errors import CorruptMinibatchError
from dlspark.io import atomic_write, read_text, write_text


def _arrays(n=10):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 3)).astype(np.float32), rng.integers(0, 2, (n, 2)).astype(np.float32)


def test_dataset_rejects_mismatched_lengths_naming_both():
    x, y = _arrays()
    with pytest.raises(ValueError, match="features\\[0\\] has 10, labels\\[0\\] has 9"):
        DataSet(x, y[:9])
    with pytest.raises(ValueError, match="labels_mask"):
        DataSet(x, y, labels_mask=np.ones(4))
    with pytest.raises(TypeError, match="sequences of arrays"):
        MultiDataSet(x, y)


@pytest.mark.parametrize("base", ["memory://mbtest", "LOCAL"])
def test_save_and_load_minibatches_round_trip(base, tmp_path):
    base = tmp_path.as_uri() if base == "LOCAL" else base
    x, y = _arrays(10)
    urls = save_minibatches(x, y, base + "/set", batch_size=4)
    assert [u.rsplit("/", 1)[1] for u in urls] == ["batch_000000.npz", "batch_000001.npz", "batch_000002.npz"]
    back = [load_minibatch(u) for u in urls]
    assert [len(b) for b in back] == [4, 4, 2]
    merged = DataSet.merge(back)
    np.testing.assert_array_equal(merged.features, x)
    np.testing.assert_array_equal(merged.labels, y)
    # Listing may spell the protocol differently (memory:/// vs memory://); the files are the same.
    def paths(us):
        return [fsspec.core.url_to_fs(u)[1] for u in us]

    assert paths(list_minibatches(base + "/set")) == paths(urls)
    assert paths(list_minibatches(base + "/set/*.npz")) == paths(urls)
    assert all(load_minibatch(u).num_examples for u in list_minibatches(base + "/set"))


def test_multidataset_and_masks_round_trip():
    x, y = _arrays(6)
    ds = MultiDataSet([x, x[:, :2]], [y], features_masks=[np.ones((6,)), None], labels_masks=[np.arange(6) % 2])
    url = save_dataset(ds, "memory://mds/one.npz")
    back = load_minibatch(url)
    assert isinstance(back, MultiDataSet)
    assert len(back.features) == 2 and back.features_masks[1] is None
    np.testing.assert_array_equal(back.labels_masks[0], np.arange(6) % 2)
    single = DataSet(x, y, labels_mask=np.ones(6))
    back = load_minibatch(save_dataset(single, "memory://mds/two.npz"))
    assert isinstance(back, DataSet) and back.labels_mask is not None


def test_corrupt_truncated_missing_and_foreign_files_name_the_url(tmp_path):
    x, y = _arrays()
    good = save_dataset(DataSet(x, y), str(tmp_path / "good.npz"))
    raw = open(good, "rb").read()
    trunc = tmp_path / "trunc.npz"
    trunc.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CorruptMinibatchError, match="trunc.npz"):
        load_minibatch(str(trunc))
    with pytest.raises(CorruptMinibatchError, match="missing.npz.*not found"):
        load_minibatch(str(tmp_path / "missing.npz"))
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, a=np.zeros(3))
    with pytest.raises(CorruptMinibatchError, match="foreign.npz.*'a' is not part of the format"):
        load_minibatch(str(foreign))
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, features=np.array([{"x": 1}], dtype=object), labels=np.zeros(1))
    with pytest.raises(CorruptMinibatchError, match="pickled.npz"):
        load_minibatch(str(pickled))


@pytest.mark.parametrize("compressed", [False, True])
def test_minibatch_files_read_as_np_load_reads_them(tmp_path, compressed):
    # Stored members are read in place (not through np.load): every dtype, order and shape
    # np.savez can write must come back as np.load gives it, writable; compressed files
    # (np.savez_compressed) take np.load's path.
    rng = np.random.default_rng(0)
    arrays = {"features_0": rng.normal(size=(5, 3, 2)).astype(np.float32),
              "features_1": np.asfortranarray(rng.normal(size=(5, 4))),
              "labels_0": np.arange(5, dtype=">i4").reshape(5, 1),
              "labels_1": rng.integers(0, 2, (5, 0)).astype(np.int8),
              "features_mask_0": np.array([True, False, True, True, False]),
              "labels_mask_1": rng.normal(size=5).astype(np.float16)}
    path = tmp_path / "many.npz"
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    back = load_minibatch(str(path))
    with np.load(path) as z:
        expected = {k: z[k] for k in z.files}
    got = {"features_0": back.features[0], "features_1": back.features[1], "labels_0": back.labels[0],
           "labels_1": back.labels[1], "features_mask_0": back.features_masks[0], "labels_mask_1": back.labels_masks[1]}
    for k, want in expected.items():
        assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
        np.testing.assert_array_equal(got[k], want)
        assert got[k].flags.writeable, k


def test_a_header_seen_before_is_not_parsed_again_and_each_file_keeps_its_own(tmp_path, monkeypatch):
    # a worker reads thousands of files of a few shapes: numpy's parser runs once per distinct
    # header, and files of other shapes and dtypes, read in turn, each come back as written
    from dlspark.data import _files

    calls = []
    parse = _files._NPY_HEADERS[(1, 0)]
    monkeypatch.setitem(_files._NPY_HEADERS, (1, 0), lambda f: calls.append(1) or parse(f))
    monkeypatch.setattr(_files, "_PARSED_HEADERS", {})
    rng = np.random.default_rng(1)
    files = {}
    for name, (n, dtype) in {"a": (4, np.float32), "b": (6, np.float32), "c": (4, np.float64)}.items():
        data = DataSet(rng.normal(size=(n, 3)).astype(dtype), rng.normal(size=(n, 2)).astype(np.float32))
        files[name] = (save_dataset(data, str(tmp_path / f"{name}.npz")), data)
    for _ in range(3):
        for url, data in files.values():
            back = load_minibatch(url)
            assert back.features.dtype == data.features.dtype
            np.testing.assert_array_equal(back.features, data.features)
            np.testing.assert_array_equal(back.labels, data.labels)
    # features of (4, 3) f4, (6, 3) f4, (4, 3) f8, labels of (4, 2) and (6, 2): five headers, nine reads
    assert len(calls) == 5
    # a header the cache holds does not make a member with less data than it says readable: a
    # well-formed zip (its CRCs right) whose features member lost its last element
    _, data = files["a"]
    with zipfile.ZipFile(tmp_path / "short.npz", "w") as z:
        for name, array in (("features", data.features), ("labels", data.labels)):
            npy = io.BytesIO()
            np.save(npy, array)
            z.writestr(f"{name}.npy", npy.getvalue()[:-4] if name == "features" else npy.getvalue())
    with pytest.raises(CorruptMinibatchError, match="short.npz.*'features.npy' holds 44 bytes of data, not the 48"):
        load_minibatch(str(tmp_path / "short.npz"))
    assert len(calls) == 5  # its header was the cached one


def test_a_flipped_bit_in_a_minibatch_file_is_refused_not_read(tmp_path):
    x, y = _arrays(50)
    good = save_dataset(DataSet(x, y), str(tmp_path / "good.npz"))
    raw = bytearray(open(good, "rb").read())
    body = raw.index(b"\x93NUMPY") + 128 + 40  # inside the features' data
    raw[body] ^= 0x04
    bad = tmp_path / "flipped.npz"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CorruptMinibatchError, match="flipped.npz.*CRC"):
        load_minibatch(str(bad))
    # Member names are not under the CRC: a changed one must not make an array vanish
    # (a mask read as absent), nor may a local header name another member than the directory.
    masked = save_dataset(DataSet(x, y, labels_mask=np.ones(50)), str(tmp_path / "masked.npz"))
    raw = open(masked, "rb").read()
    central = raw.rindex(b"labels_mask.npy")
    renamed = tmp_path / "renamed.npz"
    renamed.write_bytes(raw[:central] + b"labels_mask.npx" + raw[central + 15:])
    with pytest.raises(CorruptMinibatchError, match="renamed.npz"):
        load_minibatch(str(renamed))
    local = raw.index(b"labels.npy")
    swapped = tmp_path / "swapped.npz"
    swapped.write_bytes(raw[:local] + b"labelz.npy" + raw[local + 10:])
    with pytest.raises(CorruptMinibatchError, match="swapped.npz"):
        load_minibatch(str(swapped))


def test_crashed_write_leaves_no_file_that_a_reader_takes_for_a_minibatch(tmp_path):
    target = tmp_path / "mb" / "batch_000000.npz"
    with pytest.raises(RuntimeError):
        with atomic_write(str(target)) as f:
            f.write(b"PK\x03\x04 half a zip")
            raise RuntimeError("crash mid-write")
    assert not target.exists()
    assert list((tmp_path / "mb").iterdir()) == []
    # A temp file left by a killed process is hidden from globs and directory listings.
    (tmp_path / "mb" / ".batch_000001.npz.abc.tmp").write_bytes(b"partial")
    save_dataset(DataSet(*_arrays()), str(target))
    assert list_minibatches(str(tmp_path / "mb")) == [str(target)]
    assert list_minibatches(str(tmp_path / "mb") + "/*.npz") == [str(target)]


def test_list_minibatches_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="matched no minibatch files"):
        list_minibatches(str(tmp_path) + "/*.npz")
    with pytest.raises(FileNotFoundError, match="no file or directory"):
        list_minibatches(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="empty"):
        list_minibatches([])
    # a list naming local files: each must exist (remote URLs are named when read)
    urls = save_minibatches(*_arrays(8), str(tmp_path / "mb"), batch_size=4)
    assert list_minibatches(urls) == urls
    with pytest.raises(FileNotFoundError, match=r"1 of the 3 listed minibatch files do not exist, e.g. '.*gone.npz'"):
        list_minibatches(urls + [str(tmp_path / "mb" / "gone.npz")])
    assert list_minibatches(["s3://bucket/not-checked.npz"]) == ["s3://bucket/not-checked.npz"]


def test_text_round_trip_any_url(tmp_path):
    for url in ("memory://txt/a.json", (tmp_path / "a.json").as_uri()):
        write_text(url, "héllo")
        assert read_text(url) == "héllo"
    assert fsspec.filesystem("memory").exists("/txt/a.json")


def test_errors_survive_pickling_across_processes():
    import pickle

    from dlspark.errors import CheckpointError, NonFiniteLossError

    for e in (CorruptMinibatchError("u.npz", "bad"), CheckpointError("c.dls", "bad"), NonFiniteLossError(3, float("nan"))):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e)


@pytest.mark.parametrize("base", ["memory://mbtest-again", "LOCAL"])
def test_saving_into_a_directory_of_minibatches_is_refused_unless_it_replaces_them(base, tmp_path):
    # A fit of the directory takes every minibatch file in it: old files left beside new ones
    # would be trained on too.
    base = (tmp_path.as_uri() if base == "LOCAL" else base) + "/set"
    x, y = _arrays(16)
    first = save_minibatches(x, y, base, batch_size=4)
    with pytest.raises(FileExistsError, match="already holds 4 minibatch file.*batch_\\*.npz.*overwrite=True"):
        save_minibatches(x[:8], y[:8], base, batch_size=4)
    assert len(list_minibatches(base)) == 4  # nothing was written or removed
    # another writer's shard, under its own prefix, goes beside them and stays
    shard = save_minibatches(x[:4] + 2, y[:4], base, batch_size=4, prefix="other")
    second = save_minibatches(x[:8] + 1, y[:8], base, batch_size=4, overwrite=True)
    assert second == first[:2]
    listed = list_minibatches(base)
    assert len(listed) == 3 and listed[2].endswith(shard[0].rsplit("/", 1)[-1])
    np.testing.assert_array_equal(DataSet.merge([load_minibatch(u) for u in listed[:2]]).features, x[:8] + 1)


def test_save_minibatches_refuses_what_it_cannot_write_by_name(tmp_path):
    x, y = _arrays(8)
    with pytest.raises(TypeError, match="directory url as a string.*got int 16"):
        save_minibatches(x, y, 16)
    with pytest.raises(ValueError, match="has no labels"):
        save_minibatches(DataSet(x, None), url=str(tmp_path / "a"))
    with pytest.raises(ValueError, match="holds no examples"):
        save_minibatches(x[:0], y[:0], str(tmp_path / "b"))
    assert not list(tmp_path.iterdir())


def test_dataset_indexing_takes_python_and_numpy_integers_and_refuses_out_of_range():
    x, y = _arrays(6)
    ds = DataSet(x, y)
    for i in (3, np.int64(3), -3):
        one = ds[i]
        assert len(one) == 1 and one.features.shape == (1,) + x.shape[1:]
        np.testing.assert_array_equal(one.features[0], x[3])
    np.testing.assert_array_equal(ds[-1].labels[0], y[-1])
    for i in (6, -7, np.int32(100)):
        with pytest.raises(IndexError, match="out of range for a data set of 6 examples"):
            ds[i]
