"""Exceptions that users may want to catch by type."""

__all__ = [
    "DlsparkError",
    "CorruptMinibatchError",
    "CheckpointError",
    "NonFiniteLossError",
    "JobFailedError",
    "VersionMismatchError",
    "ExecutorEnvironmentError",
]


class DlsparkError(Exception):
    """Base class of every error dlspark raises on purpose."""


class CorruptMinibatchError(DlsparkError, ValueError):
    """A minibatch file is missing, truncated or not in the minibatch format.

    The message names the file's URL.
    """

    def __init__(self, url, reason):
        self.url = url
        self.reason = reason
        # args hold the constructor's arguments, so the error pickles across
        # processes (worker -> scheduler -> client) by any pickler.
        super().__init__(url, reason)

    def __str__(self):
        return f"minibatch file {self.url!r}: {self.reason}"


class CheckpointError(DlsparkError, ValueError):
    """A checkpoint cannot be read, or does not match the network it is loaded into."""

    def __init__(self, url, reason):
        self.url = url
        self.reason = reason
        super().__init__(url, reason)

    def __str__(self):
        return f"checkpoint {self.url!r}: {self.reason}"


class NonFiniteLossError(DlsparkError, FloatingPointError):
    """The loss became NaN or infinite during fit.

    ``iteration`` is the network's iteration counter at the failing step; the
    network keeps the parameters it had before that step.
    """

    def __init__(self, iteration, loss):
        self.iteration = int(iteration)
        self.loss = float(loss)
        super().__init__(iteration, loss)

    def __str__(self):
        return (
            f"loss is {self.loss} at iteration {self.iteration}; the update of that step "
            "was not applied. Lower the learning rate, check the data for NaN/Inf, or pass "
            "on_nonfinite='skip' to skip such minibatches."
        )


class JobFailedError(DlsparkError, RuntimeError):
    """A distributed job could not complete (every worker was lost, or a task failed)."""


class VersionMismatchError(DlsparkError, RuntimeError):
    """The client, the scheduler and the workers run different versions of a package a job needs.

    ``mismatches`` maps each such package to ``{process: version}``; the message
    holds them as a table (see :func:`dlspark.cluster.check_versions`).
    """

    def __init__(self, message, mismatches=None):
        self.mismatches = dict(mismatches or {})
        super().__init__(message, self.mismatches)

    def __str__(self):
        return self.args[0]


class ExecutorEnvironmentError(DlsparkError, RuntimeError):
    """The Spark executors' Python cannot run dlspark (it is not installed there, or another
    version is). The message names the executors' Python, ``PYSPARK_PYTHON`` and the driver's
    ``sys.executable``, and what to set."""
