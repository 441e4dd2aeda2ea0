"""Train an MLP on the handwritten digits with DL4J-on-Spark's API: Spark holds the data, Dask trains.

    python examples/train_digits_spark.py                    # parameter averaging
    python examples/train_digits_spark.py --sharing --epochs 20   # gradient sharing (slower to converge
                                                                  # at DL4J's default sparsity band)
    python examples/train_digits_spark.py --scheduler tcp://10.0.0.5:8786   # an existing Dask cluster

The shape is DL4J's: a SparkContext, an RDD of DataSets built on the executors,
a TrainingMaster, SparkDl4jMultiLayer, ``fit`` once per epoch, distributed
evaluation. Spark runs locally (``--master local[2]``); without ``--scheduler``
training runs on an embedded Dask LocalCluster. About a minute on a laptop CPU.
"""

import argparse
import os
import sys
from functools import partial

import flax.linen as nn
import numpy as np
import optax

import dlspark
from dlspark.compat import (AdaptiveThresholdAlgorithm, ModelSerializer, ParameterAveragingTrainingMaster,
                            SharedTrainingMaster, SparkDl4jMultiLayer, VoidConfiguration)

EXAMPLES_PER_DATASET = 8  # examples in each DataSet object of the RDD


class MLP(nn.Module):
    hidden: int = 256

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.Dropout(0.1, deterministic=not train)(x)
        return nn.Dense(10)(x)


def digits_shard(split, n_parts, per_dataset, index, _):
    """Runs on a Spark executor: this partition's share of the digits, as small DataSets."""
    train, test = dlspark.datasets.digits()
    return (train if split == "train" else test)[index::n_parts].batches(per_dataset)


def digits_rdd(sc, split, n_parts=4):
    """An RDD of DataSets built by the executors: no array passes through the driver."""
    seeds = sc.parallelize(range(n_parts), n_parts)
    return seeds.mapPartitionsWithIndex(partial(digits_shard, split, n_parts, EXAMPLES_PER_DATASET))


def main(argv=None, sc=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=16, help="examples per minibatch per worker")
    ap.add_argument("--sharing", action="store_true", help="gradient sharing instead of parameter averaging")
    ap.add_argument("--master", default="local[2]", help="the Spark master")
    ap.add_argument("--scheduler", default=None, help="a Dask scheduler address (default: an embedded cluster)")
    ap.add_argument("--save", default=None, help="write the trained network here (any fsspec URL)")
    args = ap.parse_args(argv)

    own_context = sc is None
    if own_context:
        from pyspark import SparkConf, SparkContext

        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this Python, with dlspark
        conf = SparkConf().setMaster(args.master).setAppName("dlspark digits").set("spark.ui.enabled", "false")
        if args.scheduler:
            conf.set("spark.dlspark.scheduler", args.scheduler)  # else: an embedded Dask LocalCluster
        sc = SparkContext.getOrCreate(conf)
    try:
        train_data = digits_rdd(sc, "train")
        test_data = digits_rdd(sc, "test")

        # The network, as on a single machine; its learning rate decays to 0 over about the
        # steps each of two workers takes (counted on the executors: n examples / 2 / batch size)
        steps = args.epochs * train_data.map(len).sum() // (2 * args.batch_size)
        network = dlspark.Network(dlspark.Model.from_flax(MLP(), np.zeros((1, 64), np.float32)), loss="mcxent",
                                  updater=optax.adam(optax.cosine_decay_schedule(1e-2, steps)), seed=0)

        # How distributed training runs
        if args.sharing:
            void = VoidConfiguration.builder().unicastPort(40123).build()  # network fields: unused on Dask
            tm = (SharedTrainingMaster.Builder(void, EXAMPLES_PER_DATASET)
                  .batchSizePerWorker(args.batch_size)
                  .thresholdAlgorithm(AdaptiveThresholdAlgorithm(1e-3))
                  .workersPerNode(1)
                  .build())
        else:
            tm = (ParameterAveragingTrainingMaster.Builder(EXAMPLES_PER_DATASET)
                  .batchSizePerWorker(args.batch_size)
                  .averagingFrequency(5)
                  .workerPrefetchNumBatches(2)
                  .build())

        spark_net = SparkDl4jMultiLayer(sc, network, tm)
        for epoch in range(args.epochs):
            spark_net.fit(train_data)
            print(f"epoch {epoch + 1}: score {spark_net.getScore():.4f}")

        evaluation = spark_net.evaluate(test_data)  # on the Spark executors
        print(evaluation.stats())
        print(f"test accuracy {evaluation.accuracy():.4f}")
        if args.save:
            ModelSerializer.writeModel(spark_net.getNetwork(), args.save, True)
            print(f"saved to {args.save}")
        spark_net.deleteTempFiles()
        return evaluation.accuracy()
    finally:
        if own_context:
            sc.stop()


if __name__ == "__main__":
    main()
