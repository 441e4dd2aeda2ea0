"""DL4J/Spark-shaped names over dlspark (``SparkDl4jMultiLayer``, the TrainingMaster builders).

The shim translates calls only; it holds no logic of its own, and imports
pyspark only when a pyspark object is handed to it.
"""

__all__: list = []
