"""The test run's daemon for Spark's Python workers (conftest's ``sc`` names this module):
dlspark's own (``dlspark.spark.daemon``) with Keras and Equinox imported too, since the
executors unpickle tests/test_models.py's networks and so import that module."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # as tests/test_models.py sets it, before Keras starts

import equinox  # noqa: F401
import keras  # noqa: F401

from dlspark.spark.daemon import main

if __name__ == "__main__":
    main()
