"""The pyspark bridge: Spark RDDs as training, evaluation and inference input.

pyspark is never imported here: an RDD is recognised by the module its type
comes from, and every Spark call is a method of the RDD or SparkContext the
caller handed over. The rest of dlspark runs without pyspark installed.

Two halves:

- :class:`SparkRDDSource` (:mod:`dlspark.spark._source`), registered in the
  data-source registry when this package is imported (``import dlspark`` does),
  so that ``DistributedTrainer.fit(rdd)`` trains on the Dask cluster from an
  RDD of DataSets, MultiDataSets or minibatch file paths.
- Spark-side execution (:mod:`dlspark.spark._executor`): evaluation, scoring
  and keyed inference run where the RDD lives, on the executors.

The bridge sits above the core: it imports :mod:`dlspark.data` and the
inference functions, and nothing in the core imports it (an import-linter
contract in ``pyproject.toml`` keeps it so). Functions that run on executors are
module-level, so that executors import them by name (dlspark must be installed
in the executors' Python). An element of the wrong kind found by an action comes
back to the driver as a ``TypeError`` naming it (a missing minibatch file as the
core's ``CorruptMinibatchError``, data an evaluation refuses as its ``ValueError``):
one Python exception, the Spark task itself succeeding. Lazy transformations
check the RDD's first element on the driver (its kind, and whether the network
takes its shape) and raise inside Spark for a later one. Before the first job
on a SparkContext, :func:`check_executors` checks that its executors import the
driver's dlspark (:mod:`dlspark.spark._environment`).
"""

from ._common import BadElementError, is_rdd
from ._environment import check_executors
from ._executor import broadcast_network, calculate_score, do_evaluation, predict_with_keys, score_examples
from ._source import (DIRECT_MAX_BYTES, SparkRDDSource, collect_paths, direct_limit, direct_minibatches,
                      export_minibatches)

__all__ = ["SparkRDDSource", "is_rdd", "collect_paths", "export_minibatches", "direct_minibatches",
           "direct_limit", "broadcast_network", "do_evaluation", "predict_with_keys", "score_examples",
           "calculate_score", "DIRECT_MAX_BYTES", "BadElementError", "check_executors"]
