"""DL4J-on-Spark programs, in the shapes the DL4J documentation gives them, run through dlspark.compat.

Each test is one program shape written from the reference docs' usage
(evaluation, errors from the executors, the executors' Python, DataSet and
path helpers, master settings, listeners), on real pyspark ``local[2]`` (the
session's one SparkContext, ``conftest.sc``) and the module's real two-worker
Dask LocalCluster. Nothing is mocked.
"""

import os
import pathlib
import subprocess
import sys
import textwrap
import time

import flax.linen as nn
import numpy as np
import optax
import pytest
from conftest import MLP

import dlspark
from dlspark import DataSet
from dlspark.compat import Evaluation, EvaluationAveraging

ROOT = pathlib.Path(__file__).resolve().parents[1]


# -- the evaluation API, without Spark ------------------------------------------------------------
def _predictions(seed=0, n=400, k=5):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    y[:3] = 0  # class k-1 is never predicted below; class 0 is present
    p = rng.random((n, k))
    p[np.arange(n), y] += 0.6 * rng.random(n)  # better than chance, not perfect
    p[:, k - 1] = 0.0
    return np.eye(k)[y], p / p.sum(1, keepdims=True)


def test_evaluation_takes_dl4j_calls_with_dl4j_semantics():
    from sklearn.metrics import confusion_matrix, precision_score, recall_score, top_k_accuracy_score

    labels, out = _predictions()
    y, pred = labels.argmax(1), out.argmax(1)
    names = [f"c{i}" for i in range(5)]
    ev = Evaluation(names, 3)  # DL4J's Evaluation(List<String> labels, int topN)
    half = len(y) // 2
    ev.eval(labels[:half], out[:half])
    ev.eval(labels[half:], out[half:])
    assert ev.getNumRowCounter() == len(y) and ev.getTopN() == 3
    assert ev.getTopNCorrectCount() == round(top_k_accuracy_score(y, out, k=3) * len(y))
    assert ev.getTopNTotalCount() == len(y)
    cm = confusion_matrix(y, pred, labels=range(5))
    tp = np.diag(cm)
    fn, fp = cm.sum(1) - tp, cm.sum(0) - tp
    tn = len(y) - tp - fn - fp
    assert ev.truePositives() == dict(enumerate(tp.tolist()))
    assert ev.falseNegatives() == dict(enumerate(fn.tolist()))
    assert ev.getFalseNegatives().getCount(2) == fn[2] and ev.getFalseNegatives().totalCount() == fn.sum()
    assert ev.getTrueNegatives() == dict(enumerate(tn.tolist()))
    # macro averages as DL4J: a class never predicted (precision 0/0) is left out of the precision
    assert fp[4] + tp[4] == 0
    per_class = precision_score(y, pred, labels=range(5), average=None, zero_division=0)
    assert ev.precision() == pytest.approx(per_class[:4].mean())
    assert ev.precision(EvaluationAveraging.Micro) == pytest.approx(precision_score(y, pred, average="micro"))
    assert ev.recall() == pytest.approx(recall_score(y, pred, labels=range(5), average="macro"))
    assert ev.falsePositiveRate() == pytest.approx(np.mean(fp / (fp + tn)))
    assert ev.falsePositiveRate(1) == pytest.approx(fp[1] / (fp[1] + tn[1]))
    report = ev.stats(False)
    assert "# of classes:    5" in report and "Top 3 Accuracy" in report
    assert "Classes excluded from average precision: [4]" in report and "| 2 = c2" in report
    assert "Warning" not in ev.stats(True) and "Confusion Matrix" not in ev.stats(True, False)
    # two classes: the no-argument metrics are the positive class's (1 by default, as DL4J)
    binary = Evaluation(2)
    yb = (y % 2)
    ob = np.stack([1 - out[:, 1], out[:, 1]], 1)
    binary.eval(np.eye(2)[yb], ob)
    pb = ob.argmax(1)
    assert binary.precision() == pytest.approx(precision_score(yb, pb, pos_label=1))
    zero = Evaluation(2, 0)
    zero.eval(np.eye(2)[yb], ob)
    assert zero.recall() == pytest.approx(recall_score(yb, pb, pos_label=0))
    assert "positive class (class 0" in zero.stats()
    # one example at a time: eval(predictedIdx, actualIdx)
    one = Evaluation(3)
    one.eval(2, 1)
    one.eval(1, 1)
    assert one.getConfusionMatrix().tolist() == [[0, 0, 0], [0, 1, 1], [0, 0, 0]]
    back = Evaluation.fromJson(ev.toJson())
    assert type(back) is Evaluation and back == ev and back.getTopNCorrectCount() == ev.getTopNCorrectCount()
    # DL4J's names in errors and suggestions
    with pytest.raises(AttributeError, match=r"closest known: getNumRowCounter"):
        ev.getNumRowCount()
    with pytest.raises(AttributeError, match=r"closest known: .*falsePositiveRate"):
        ev.falsePositivesRate()
    with pytest.raises(TypeError, match=r"\(labels\[, topN or costArray\]\)"):
        Evaluation({"a"})
    with pytest.raises(ValueError, match="binaryPositiveClass needs 2 classes"):
        Evaluation(5, 1)


# -- on Spark and Dask -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(client2):
    """The module's two-worker LocalCluster, the one dlspark.compat trains on."""
    dlspark.compat.configure(client=client2)
    yield client2
    dlspark.compat.configure(client=None)


def digits_part(split, n_parts, per_dataset, index, _):
    """Runs on an executor: a share of the digits as DataSets of ``per_dataset`` examples."""
    train, test = dlspark.datasets.digits()
    return (train if split == "train" else test)[index::n_parts].batches(per_dataset)


def digits_rdd(sc, split="train", per_dataset=32, n_parts=4):
    from functools import partial

    return sc.parallelize(range(n_parts), n_parts).mapPartitionsWithIndex(
        partial(digits_part, split, n_parts, per_dataset))


def new_net(seed=0, updater=None):
    x = np.zeros((1, 64), np.float32)
    return dlspark.Network(dlspark.Model.from_flax(MLP(hidden=32), x), loss="mcxent",
                           updater=updater or optax.adam(3e-3), seed=seed)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_list_fit_paths_and_evaluate_with_listeners(sc, cluster, tmp_path, caplog):
    """The docs' export-then-fitPaths program: DataSetExportFunction writes the RDD, listPaths lists it,
    fitPaths trains with a score, a performance and a stats listener, doEvaluation reads the files."""
    import logging

    from click.testing import CliRunner

    from dlspark.cli import main
    from dlspark.compat import (BatchAndExportDataSetsFunction, DataSetExportFunction, FileStatsStorage,
                                ParameterAveragingTrainingMaster, PerformanceListener, ScoreIterationListener,
                                SparkDl4jMultiLayer, SparkUtils, StatsListener, TrainingListener)
    from dlspark.data import load_minibatch

    train = digits_rdd(sc)
    # DataSet's DL4J names, inside Spark tasks
    assert train.map(lambda d: d.numExamples()).sum() == 1438
    assert set(train.map(lambda d: d.getFeatures().shape[1] + d.getLabels().shape[1]).collect()) == {74}
    out = str(tmp_path / "exported")
    train.foreachPartition(DataSetExportFunction(out))
    paths = SparkUtils.listPaths(sc, out)
    assert paths.count() == train.count() and paths.first().endswith(".npz")
    assert SparkUtils.listPaths(sc, out, False, ["bin"]).count() == 0
    batched = train.mapPartitionsWithIndex(BatchAndExportDataSetsFunction(16, str(tmp_path / "batched"))).collect()
    sizes = [len(load_minibatch(p)) for p in batched]
    assert sum(sizes) == 1438 and max(sizes) == 16 and sum(s < 16 for s in sizes) <= 4  # one short file a partition

    class Rounds(TrainingListener):
        def __init__(self):
            self.seen, self.ended = [], 0

        def iterationDone(self, model, iteration, epoch):
            self.seen.append((iteration, epoch, model.score()))

        def onEpochEnd(self, model):
            self.ended += 1

    rounds, stats_listener = Rounds(), StatsListener(None)
    tm = ParameterAveragingTrainingMaster.Builder(32).batchSizePerWorker(32).averagingFrequency(3).build()
    spark_net = SparkDl4jMultiLayer(sc, new_net(), tm)
    stats_file = str(tmp_path / "stats.json")
    spark_net.setListeners(FileStatsStorage(stats_file), [stats_listener, ScoreIterationListener(12),
                                                          PerformanceListener(1, True), rounds])
    with caplog.at_level(logging.INFO, logger="dlspark.compat"):
        for _ in range(2):
            spark_net.fitPaths(paths)
    net = spark_net.getNetwork()
    # iterationDone once per iteration (each file is one minibatch), numbered as DL4J does: the
    # network's count before the minibatch, from 0 up; every score that minibatch's finite loss
    k = paths.count()
    assert rounds.ended == 2 and len(rounds.seen) == 2 * k == net.iteration
    assert [i for i, _, _ in rounds.seen] == list(range(2 * k))
    assert [e for _, e, _ in rounds.seen] == [0] * k + [1] * k
    assert all(np.isfinite(s) for _, _, s in rounds.seen) and len({s for _, _, s in rounds.seen}) > k
    scores = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Score at iteration")]
    assert scores[:2] == [f"Score at iteration {i} is {rounds.seen[i][2]}" for i in (0, 12)]
    assert len(scores) == len(range(0, 2 * k, 12))
    assert sum("samples/sec" in r.getMessage() and "score:" in r.getMessage() for r in caplog.records) == 2 * k
    # the stats file opens with `dlspark stats`; the listener kept each round once
    n_rounds = len(stats_listener.rounds)
    assert sum(len(r["iterations"]) for r in stats_listener.rounds) == 2 * k and n_rounds < k
    result = CliRunner().invoke(main, ["stats", stats_file])
    assert result.exit_code == 0, result.output
    assert f"{n_rounds} rounds" in result.output
    # DL4J's doEvaluation(paths, loader, evaluations...) on the executors
    ev, reg = spark_net.doEvaluation(paths, load_minibatch, Evaluation(), dlspark.compat.RegressionEvaluation())
    assert ev.getNumRowCounter() == 1438 and ev.accuracy() > 0.6 and reg.num_columns() == 10  # chance: 0.1
    spark_net.setDefaultEvaluationWorkers(2)
    assert spark_net.getDefaultEvaluationWorkers() == 2
    assert spark_net.evaluate(paths).getNumRowCounter() == 1438
    x = np.asarray(dlspark.datasets.digits()[1].features[:5])
    assert np.array_equal(spark_net.predict(x), net.output(x))
    with pytest.raises(ValueError, match="inject_hyperparams"):
        spark_net.getLearningRate()
    spark_net.setNetwork(new_net(updater=optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)))
    assert spark_net.getLearningRate(0) == pytest.approx(0.05)
    with pytest.raises(TypeError, match="setListeners takes DL4J-style listeners.*has no iterationDone"):
        spark_net.setListeners(print)
    with pytest.raises(ValueError, match="StatsListener\\(None\\) needs a statsStorage"):
        spark_net.setListeners(StatsListener(None))


def _short_python_error(excinfo):
    """The error is one short Python exception raised on the driver, not Spark's Java trace."""
    e = excinfo.value
    assert not type(e).__module__.startswith(("py4j", "pyspark")), type(e)
    assert "Py4JJavaError" not in str(e) and len(str(e).splitlines()) <= 3, str(e)


@pytest.mark.slow
def test_errors_on_the_executors_reach_the_driver_as_one_python_exception(sc):
    from dlspark.compat import SparkDl4jMultiLayer

    net = new_net()
    spark_net = SparkDl4jMultiLayer(sc, net, None)
    _, test = dlspark.datasets.digits()
    good = sc.parallelize(test.batches(64), 2)
    three = sc.parallelize([DataSet(d.features, d.labels[:, :3]) for d in test.batches(64)], 2)
    with pytest.raises(ValueError, match=r"labels of shape \(\d+, 3\) do not match predictions of shape") as e:
        spark_net.doEvaluation(three, 64, Evaluation())
    _short_python_error(e)
    with pytest.raises(ValueError, match="ROC takes 1 or 2 output columns, got 10; use ROCMultiClass") as e:
        spark_net.evaluateROC(good)
    _short_python_error(e)
    with pytest.raises(ValueError, match=r"got outputs with 10 columns") as e:
        spark_net.doEvaluation(good, 64, Evaluation(3))
    _short_python_error(e)
    narrow = sc.parallelize([DataSet(d.features[:, :60], d.labels) for d in test.batches(64)], 2)
    with pytest.raises(Exception) as e:
        spark_net.evaluate(narrow)
    _short_python_error(e)
    keyed = sc.parallelize([(i, np.asarray(test.features[i, :60])) for i in range(100)], 2)
    with pytest.raises(ValueError, match=r"feedForwardWithKey: the RDD's first element does not fit the network: "
                                         r"the model cannot take features of shape \(64, 60\)") as e:
        spark_net.feedForwardWithKey(keyed, 64)
    _short_python_error(e)
    # the SparkContext and the network are as usable as before
    assert sc.parallelize(range(10), 2).sum() == 45
    assert spark_net.evaluate(good).getNumRowCounter() == len(test)
    ok = sc.parallelize([(i, np.asarray(test.features[i])) for i in range(100)], 2)
    out = dict(spark_net.feedForwardWithKey(ok, 64).collect())
    assert np.allclose(out[7], net.output(np.asarray(test.features[7:8]))[0], atol=1e-5)
    # keyed inference is lazy: an element of another shape late in the RDD (the driver checks only
    # the first) fails at the user's action, as one Python exception, whatever the action
    late = sc.parallelize([(i, np.asarray(test.features[i, :60 if i == 90 else 64])) for i in range(100)], 2)
    outputs = spark_net.feedForwardWithKey(late, 64)  # the first element fits: no job fails yet
    for action in (lambda r: r.collect(), lambda r: r.count(), lambda r: r.collectAsMap(),
                   lambda r: r.mapValues(np.argmax).values().sum(), lambda r: r.filter(lambda kv: kv[0] > 80).take(20)):
        with pytest.raises(ValueError, match=r"feedForwardWithKey: the element with key 90 has features of shape "
                                             r"\(60,\), the element with key 50 \(64,\)") as e:
            action(outputs)
        _short_python_error(e)
    assert outputs.take(3)[2][0] == 2  # a partition without the bad element still computes
    scores = spark_net.scoreExamples(sc.parallelize([(i, d) for i, d in enumerate(test.batches(64))] +
                                                    [(99, DataSet(test.features[:4, :60], test.labels[:4]))], 2))
    with pytest.raises(ValueError, match=r"scoreExamples: the DataSet with key 99 has examples of features shape "
                                         r"\(\(60,\),\), the partition's first \(\(64,\),\)") as e:
        scores.collect()
    _short_python_error(e)
    # the SparkContext and the network are still usable
    assert sc.parallelize(range(10), 2).sum() == 45
    assert len(spark_net.feedForwardWithKey(ok, 64).collect()) == 100


@pytest.mark.slow
def test_executors_that_cannot_import_dlspark_fail_at_the_first_call(tmp_path):
    """A script run without PYSPARK_PYTHON: the executors run the `python3` found on PATH, here a
    virtual environment without dlspark. The first dlspark call raises one Python exception
    naming PYSPARK_PYTHON and the driver's Python; the SparkContext stays usable."""
    pytest.importorskip("pyspark")
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent("""
        import flax.linen as nn
        import numpy as np
        from pyspark import SparkConf, SparkContext
        import dlspark
        from dlspark.compat import SparkDl4jMultiLayer
        from dlspark.errors import ExecutorEnvironmentError

        if __name__ == "__main__":
            # the JVM as the tests' shared context starts it (conftest.sc): its quick compiler alone
            sc = SparkContext(conf=SparkConf().setMaster("local[1]").setAppName("bare")
                              .set("spark.ui.enabled", "false").set("spark.ui.showConsoleProgress", "false")
                              .set("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"))
            sc.setLogLevel("ERROR")
            net = dlspark.Network(dlspark.Model.from_flax(nn.Dense(2), np.zeros((1, 4), np.float32)))
            try:
                SparkDl4jMultiLayer(sc, net, None)
            except ExecutorEnvironmentError as e:
                print("RAISED:" + str(e))
            print("STILL USABLE:", sc.parallelize(range(4), 1).map(lambda x: x + 1).sum())
            sc.stop()
            SparkDl4jMultiLayer(SparkContext(conf=SparkConf().setMaster("local[1]").set("spark.ui.enabled", "false")),
                                net, None)  # uncaught: how a script ends
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    env["PATH"] = f"{bare / 'bin'}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    out = run.stdout
    assert "RAISED:" in out, (out, run.stderr[-3000:])
    message = out.split("RAISED:", 1)[1].split("STILL USABLE")[0]
    assert "cannot import dlspark" in message and "ModuleNotFoundError" in message
    assert "PYSPARK_PYTHON" in message and sys.executable in message and str(bare) in message
    assert "STILL USABLE: 10" in out
    assert run.returncode != 0
    assert run.stderr.rstrip().splitlines()[-1].startswith("dlspark.errors.ExecutorEnvironmentError: ")
    assert "Py4JJavaError" not in run.stderr


def test_dealt_order_is_seeded_per_epoch():
    from dlspark.compat._runtime import dealt

    refs = [f"f{i}.npz" for i in range(50)]
    assert dealt(refs, None, 3) == refs
    assert dealt(refs, 7, 0) == dealt(refs, 7, 0) and sorted(dealt(refs, 7, 0)) == sorted(refs)
    assert dealt(refs, 7, 0) != dealt(refs, 7, 1) and dealt(refs, 7, 0) != dealt(refs, 8, 0)


@pytest.mark.slow
@pytest.mark.timeout(900)  # four fits and a refused one; compilation under load takes minutes
def test_master_settings_do_what_they_say(sc, cluster, tmp_path):
    from conftest import tree_equal

    from dlspark.compat import (BatchAndExportDataSetsFunction, ParameterAveragingTrainingMaster,
                                SharedTrainingMaster, SparkDl4jMultiLayer, SparkUtils, TrainingListener)
    from dlspark.compat._runtime import GC_PLUGIN

    out = str(tmp_path / "batches")
    digits_rdd(sc).mapPartitionsWithIndex(BatchAndExportDataSetsFunction(32, out)).count()

    def fitted(seed):
        builder = ParameterAveragingTrainingMaster.Builder(32).batchSizePerWorker(32).averagingFrequency(2)
        tm = (builder if seed is None else builder.rngSeed(seed)).build()
        spark_net = SparkDl4jMultiLayer(sc, new_net(), tm)
        paths = SparkUtils.listPaths(sc, out)
        spark_net.fitPaths(paths)
        assert paths.is_cached and str(paths.getStorageLevel()) == "Memory Serialized 1x Replicated"  # storageLevelStreams
        return spark_net.getNetwork().state.params

    # rngSeed seeds the deal of minibatches to workers: the same seed trains alike, another differently
    one, again, other = fitted(1), fitted(1), fitted(2)
    assert tree_equal(one, again) and not tree_equal(one, other)

    class Workers(TrainingListener):
        seen = []

        def iterationDone(self, model, iteration, epoch):
            self.seen.append(model.record["workers"])

        def onEpochEnd(self, model):
            pass

    # workersPerNode(1): one worker of the (one-machine, two-worker) cluster trains
    tm = (SharedTrainingMaster.Builder(32).batchSizePerWorker(32).workersPerNode(1)
          .workerPeriodicGCFrequency(1000).build())
    spark_net = SparkDl4jMultiLayer(sc, new_net(), tm)
    spark_net.setListeners(Workers())
    spark_net.fitPaths(SparkUtils.listPaths(sc, out))
    assert Workers.seen and set(Workers.seen) == {1}
    # workerPeriodicGCFrequency(1000) turned the periodic collection on: gc.collect runs on every
    # worker each second (a fit can end within the first second: the first runs are waited for)
    deadline = time.monotonic() + 10
    while True:
        runs = cluster.run(lambda dask_worker: dask_worker.plugins[GC_PLUGIN].collections)
        if (len(runs) == 2 and all(n > 0 for n in runs.values())) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(runs) == 2 and all(n > 0 for n in runs.values()), runs
    too_many = SharedTrainingMaster.Builder(32).workersPerNode(3).workerTogglePeriodicGC(False).build()
    with pytest.raises(ValueError, match=r"workersPerNode\(3\) trains on 3 workers of each machine, but the Dask "
                                         r"cluster runs fewer on .* \(2\)"):
        SparkDl4jMultiLayer(sc, new_net(), too_many).fitPaths(SparkUtils.listPaths(sc, out))
    assert not any(cluster.run(lambda dask_worker: GC_PLUGIN in dask_worker.plugins).values())


@pytest.mark.slow
@pytest.mark.timeout(600)  # three fits; compilation under load takes minutes
def test_checkpoint_listener_saves_every_epoch_and_every_n_iterations(sc, cluster, tmp_path):
    from conftest import tree_equal

    from dlspark.compat import (CheckpointListener, DataSetExportFunction, ModelSerializer,
                                ParameterAveragingTrainingMaster, SparkDl4jMultiLayer, SparkUtils)

    data = str(tmp_path / "data")
    digits_rdd(sc).foreachPartition(DataSetExportFunction(data))
    root = str(tmp_path / "checkpoints")
    listener = CheckpointListener.Builder(root).keepLast(2).saveEveryEpoch().saveEveryNIterations(8).build()
    tm = ParameterAveragingTrainingMaster.Builder(32).batchSizePerWorker(32).averagingFrequency(2).build()
    spark_net = SparkDl4jMultiLayer(sc, new_net(), tm)
    spark_net.setListeners(listener)
    paths = SparkUtils.listPaths(sc, data).cache()
    for _ in range(3):
        spark_net.fitPaths(paths)
    kept = CheckpointListener.availableCheckpoints(root)
    assert [os.path.basename(u) for u in kept] == ["checkpoint_1_epoch_2.dls", "checkpoint_2_epoch_3.dls"]
    assert CheckpointListener.lastCheckpoint(root) == kept[-1]
    back = ModelSerializer.restoreMultiLayerNetwork(kept[-1], network=new_net())
    assert tree_equal(back.state.params, spark_net.getNetwork().state.params)
    assert os.path.exists(listener.latest_url)  # the core's in-fit checkpoint, every 2 rounds of 2 x 2 minibatches
    with pytest.raises(ValueError, match="needs saveEveryEpoch"):
        CheckpointListener.Builder(root).build()


# -- early stopping --------------------------------------------------------------------------------
def test_early_stopping_conditions_and_configuration_follow_dl4j():
    from dlspark.compat import (BestScoreEpochTerminationCondition, EarlyStoppingConfiguration,
                                InvalidScoreIterationTerminationCondition, MaxEpochsTerminationCondition,
                                MaxScoreIterationTerminationCondition, MaxTimeIterationTerminationCondition,
                                ScoreImprovementEpochTerminationCondition, TimeUnit)

    assert [MaxEpochsTerminationCondition(3).terminate(e, 0.0) for e in range(3)] == [False, False, True]
    c = ScoreImprovementEpochTerminationCondition(2, 0.05)
    # 0.97 improves on 1.0 by less than 0.05: no improvement; 0.8 does; two epochs after it, stop
    assert [c.terminate(e, s) for e, s in enumerate([1.0, 0.97, 0.8, 0.79, 0.9])] == [False, False, False, False,
                                                                                       True]
    c.initialize()  # a new fit starts afresh
    assert not c.terminate(0, 5.0) and not c.terminate(1, 6.0)
    up = ScoreImprovementEpochTerminationCondition(1)
    assert [up.terminate(e, s, False) for e, s in enumerate([0.5, 0.6, 0.6])] == [False, False, True]  # maximized
    assert BestScoreEpochTerminationCondition(0.1).terminate(0, 0.05)
    assert not BestScoreEpochTerminationCondition(0.9, False).terminate(0, 0.8)
    assert MaxScoreIterationTerminationCondition(2.0).terminate(float("nan"))
    assert not MaxScoreIterationTerminationCondition(2.0).terminate(1.5)
    assert InvalidScoreIterationTerminationCondition().terminate(float("inf"))
    timed = MaxTimeIterationTerminationCondition(2, TimeUnit.MINUTES)
    assert timed.max_seconds == 120 and not timed.terminate(1.0)
    assert MaxTimeIterationTerminationCondition(1, "milliseconds").max_seconds == pytest.approx(1e-3)
    assert str(MaxEpochsTerminationCondition(7)) == "MaxEpochsTerminationCondition(7)"
    with pytest.raises(ValueError, match="timeUnit must be one of TimeUnit.NANOSECONDS.*got 'fortnights'"):
        MaxTimeIterationTerminationCondition(1, "fortnights")
    with pytest.raises(ValueError, match="maxEpochs must be an integer >= 1, got 0"):
        MaxEpochsTerminationCondition(0)
    with pytest.raises(ValueError, match="needs a termination condition before build"):
        EarlyStoppingConfiguration.Builder().build()
    with pytest.raises(TypeError, match="epochTerminationConditions takes epoch conditions.*got "
                                        "MaxTimeIterationTerminationCondition"):
        EarlyStoppingConfiguration.Builder().epochTerminationConditions(timed)
    with pytest.raises(AttributeError, match="closest known: evaluateEveryNEpochs"):
        EarlyStoppingConfiguration.Builder().evaluateEveryNEpoch(2)
    conf = EarlyStoppingConfiguration.Builder().iterationTerminationConditions(timed).build()
    assert conf.getEvaluateEveryNEpochs() == 1 and not conf.isSaveLastModel()
    assert type(conf.getModelSaver()).__name__ == "InMemoryModelSaver"


def test_early_stopping_ends_with_an_error_result_as_dl4j(sc):
    """DL4J's trainer does not raise what a fit raises: it ends with TerminationReason.Error."""
    from dlspark.compat import (EarlyStoppingConfiguration, EarlyStoppingListener, MaxEpochsTerminationCondition,
                                SparkEarlyStoppingTrainer, TerminationReason)

    class Done(EarlyStoppingListener):
        result = None

        def onCompletion(self, esResult):
            Done.result = esResult

    conf = EarlyStoppingConfiguration.Builder().epochTerminationConditions(MaxEpochsTerminationCondition(2)).build()
    trainer = SparkEarlyStoppingTrainer(sc, None, conf, new_net(), digits_rdd(sc, "test"))  # no training master
    trainer.setListener(Done())
    result = trainer.fit()
    assert result is Done.result and result.getTerminationReason() is TerminationReason.Error
    assert result.getTerminationDetails().startswith("ValueError: this SparkDl4jMultiLayer has no training master")
    assert result.getTotalEpochs() == 0 and result.getBestModel() is None and result.getScoreVsEpoch() == {}
    with pytest.raises(TypeError, match="esConfig must be EarlyStoppingConfiguration.Builder"):
        SparkEarlyStoppingTrainer(sc, None, MaxEpochsTerminationCondition(2), new_net(), None)


@pytest.mark.slow
@pytest.mark.timeout(600)  # eight one-epoch fits; compilation under load takes minutes
def test_spark_early_stopping_trainer_stops_and_keeps_the_best_model(sc, cluster, tmp_path):
    from conftest import tree_equal

    from dlspark.compat import (EarlyStoppingConfiguration, EarlyStoppingListener, InMemoryModelSaver,
                                LocalFileModelSaver, MaxEpochsTerminationCondition,
                                MaxScoreIterationTerminationCondition, ParameterAveragingTrainingMaster,
                                ScoreImprovementEpochTerminationCondition, SparkDataSetLossCalculator,
                                SparkEarlyStoppingTrainer, TerminationReason)

    train = digits_rdd(sc, "test")  # 360 examples: 12 minibatches an epoch
    held_out = digits_rdd(sc, "train", per_dataset=256, n_parts=2)
    tm = ParameterAveragingTrainingMaster.Builder(32).batchSizePerWorker(32).averagingFrequency(2).build()

    class Epochs(EarlyStoppingListener):
        def __init__(self):
            self.seen, self.done = {}, None

        def onEpoch(self, epochNum, score, esConfig, net):
            self.seen[epochNum] = (score, net.state.params)

        def onCompletion(self, esResult):
            self.done = esResult

    # max epochs, scored on the executors: three epochs, the best of them kept
    net, epochs = new_net(), Epochs()
    conf = (EarlyStoppingConfiguration.Builder()
            .epochTerminationConditions(MaxEpochsTerminationCondition(3), ScoreImprovementEpochTerminationCondition(5))
            .scoreCalculator(SparkDataSetLossCalculator(held_out, True, sc)).modelSaver(InMemoryModelSaver()).build())
    trainer = SparkEarlyStoppingTrainer(sc, tm, conf, net, train)
    trainer.setListener(epochs)
    result = trainer.fit()
    assert result is epochs.done and result.getTerminationReason() is TerminationReason.EpochTerminationCondition
    assert result.getTerminationDetails() == "MaxEpochsTerminationCondition(3)" and result.getTotalEpochs() == 3
    scores = result.getScoreVsEpoch()
    assert sorted(scores) == [0, 1, 2] and scores == {e: s for e, (s, _) in epochs.seen.items()}
    assert scores[2] < scores[0]  # it learns
    best = min(scores, key=scores.get)
    assert result.getBestModelEpoch() == best and result.getBestModelScore() == scores[best]
    assert tree_equal(result.getBestModel().state.params, epochs.seen[best][1])
    assert net.iteration == 3 * train.count()

    # no improvement for two epochs after the best: the scores a calculator gives decide
    class Scripted:
        def __init__(self, scores):
            self.scores = list(scores)

        def calculateScore(self, network):
            return self.scores.pop(0)

        def minimizeScore(self):
            return True

    net, epochs, saved = new_net(), Epochs(), str(tmp_path / "es")
    conf = (EarlyStoppingConfiguration.Builder()
            .epochTerminationConditions(MaxEpochsTerminationCondition(10), ScoreImprovementEpochTerminationCondition(2))
            .scoreCalculator(Scripted([1.0, 0.5, 0.6, 0.7, 0.1])).modelSaver(LocalFileModelSaver(saved))
            .saveLastModel(True).build())
    trainer = SparkEarlyStoppingTrainer(sc, tm, conf, net, train)
    trainer.setListener(epochs)
    result = trainer.fit()
    assert result.getTerminationReason() is TerminationReason.EpochTerminationCondition
    assert result.getTerminationDetails().startswith("ScoreImprovementEpochTerminationCondition(maxEpochsWithNo"
                                                     "Improvement=2")
    assert result.getTotalEpochs() == 4 and result.getBestModelEpoch() == 1 and result.getBestModelScore() == 0.5
    assert result.getScoreVsEpoch() == {0: 1.0, 1: 0.5, 2: 0.6, 3: 0.7}
    restored = result.getBestModel()  # epoch 1's parameters, read back from bestModel.bin
    assert tree_equal(restored.state.params, epochs.seen[1][1]) and not tree_equal(restored.state.params,
                                                                                    net.state.params)
    assert tree_equal(conf.getModelSaver().getLatestModel().state.params, net.state.params)
    elsewhere = LocalFileModelSaver(saved)  # another process reading the directory: it says what it needs
    with pytest.raises(ValueError, match="saved no network in this process.*getBestModel\\(network=net\\)"):
        elsewhere.getBestModel()
    assert tree_equal(elsewhere.getBestModel(network=new_net()).state.params, epochs.seen[1][1])

    # an iteration condition: every minibatch's loss is above 0, so the first epoch is the last
    conf = (EarlyStoppingConfiguration.Builder().iterationTerminationConditions(MaxScoreIterationTerminationCondition(0.0))
            .epochTerminationConditions(MaxEpochsTerminationCondition(5)).build())
    result = SparkEarlyStoppingTrainer(sc, tm, conf, new_net(), train).fit()
    assert result.getTerminationReason() is TerminationReason.IterationTerminationCondition
    assert result.getTerminationDetails() == "MaxScoreIterationTerminationCondition(0.0)"
    assert result.getTotalEpochs() == 1 and result.getBestModelEpoch() == -1 and result.getBestModel() is None


# -- DL4J's recurrent layout ---------------------------------------------------------------------------
class SeqNet(nn.Module):
    """A GRU over [examples, time, features], one 3-class output per time step."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.RNN(nn.GRUCell(8))(x))


def _sequences(n=96, t=5, f=4, seed=0):
    """NWC sequences whose class at each step follows the running sum of the first feature."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, t, f)).astype(np.float32)
    y = np.eye(3, dtype=np.float32)[np.digitize(np.cumsum(x[:, :, 0], 1), [-0.5, 0.5])]
    mask = np.ones((n, t), np.float32)
    mask[::4, -2:] = 0  # some sequences end early
    return x, y, mask


def _seq_part(ncw, index, _):
    """Runs on an executor: a quarter of the sequences as DataSets of 8, in NCW or NWC."""
    x, y, mask = _sequences()
    sl = slice(index * 24, (index + 1) * 24)
    x, y, mask = x[sl], y[sl], mask[sl]
    if ncw:  # DL4J's layout: [examples, features/classes, time]
        x, y = x.swapaxes(1, 2), y.swapaxes(1, 2)
    return DataSet(x, y, mask, mask).batches(8)


@pytest.mark.slow
@pytest.mark.timeout(600)  # two fits of a recurrent network; compilation under load takes minutes
def test_rnn_data_format_ncw_trains_evaluates_and_infers_as_nwc(sc, cluster, tmp_path):
    from functools import partial

    from conftest import tree_equal

    from dlspark.compat import DataSetExportFunction, ParameterAveragingTrainingMaster, RNNFormat, SparkDl4jMultiLayer

    def rdd(ncw):
        return sc.parallelize(range(4), 4).mapPartitionsWithIndex(partial(_seq_part, ncw))

    def seq_net():
        x = np.zeros((1, 5, 4), np.float32)
        return dlspark.Network(dlspark.Model.from_flax(SeqNet(), x), loss="mcxent", updater=optax.adam(1e-2), seed=3)

    tm = ParameterAveragingTrainingMaster.Builder(8).batchSizePerWorker(8).averagingFrequency(2).build()
    nwc = SparkDl4jMultiLayer(sc, seq_net(), tm, rnnDataFormat="NWC")
    ncw = SparkDl4jMultiLayer(sc, seq_net(), tm)  # DL4J's default
    assert ncw.getRnnDataFormat() is RNNFormat.NCW and nwc.getRnnDataFormat() is RNNFormat.NWC
    nwc.fit(rdd(False))
    ncw.fit(rdd(True))  # exported by the executors in the network's layout
    assert tree_equal(nwc.getNetwork().state.params, ncw.getNetwork().state.params)
    assert ncw.getNetwork().iteration == 12

    # evaluation and scoring on the executors: the same figures from either layout
    a, b = nwc.evaluate(rdd(False)), ncw.evaluate(rdd(True))
    assert a.getNumRowCounter() == b.getNumRowCounter() == 96 * 5 - 24 * 2  # masked steps left out
    assert a.accuracy() == b.accuracy()
    assert nwc.calculateScore(rdd(False)) == pytest.approx(ncw.calculateScore(rdd(True)), rel=1e-6)
    # files written in DL4J's layout, read back by the executors through the network's loader
    out = str(tmp_path / "ncw")
    rdd(True).foreachPartition(DataSetExportFunction(out))
    assert ncw.evaluate(out).accuracy() == b.accuracy()

    # outputs come back in the layout they went in: predict and keyed inference
    x, _, mask = _sequences(8, seed=1)
    np.testing.assert_allclose(ncw.predict(x.swapaxes(1, 2)), np.swapaxes(nwc.predict(x), 1, 2), rtol=1e-6)
    keyed = sc.parallelize([(i, x[i].T) for i in range(8)], 2)  # one example: [features, time]
    got = dict(ncw.feedForwardWithKey(keyed).collect())
    assert got[3].shape == (3, 5)
    np.testing.assert_allclose(np.stack([got[i] for i in range(8)]), np.swapaxes(nwc.predict(x), 1, 2),
                               rtol=1e-5, atol=1e-6)
    masked = dict(ncw.feedForwardWithMaskAndKey(sc.parallelize([(i, (x[i].T, mask[i])) for i in range(8)])).collect())
    assert masked[0].shape == (3, 5)
    with pytest.raises(ValueError, match="rnnDataFormat must be one of RNNFormat.NCW, RNNFormat.NWC, got 'NHWC'"):
        SparkDl4jMultiLayer(sc, seq_net(), tm, rnnDataFormat="NHWC")
