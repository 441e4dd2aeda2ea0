"""DL4J's early-stopping termination conditions (``org.deeplearning4j.earlystopping.termination``).

Epoch conditions are asked ``terminate(epochNum, score, minimize)`` after each evaluated
epoch, iteration conditions ``terminate(lastMiniBatchScore)`` per iteration; each is
``initialize()``-d when a fit starts and prints as DL4J's ``toString`` does (the
result's ``getTerminationDetails``).
"""

from __future__ import annotations

import math
import time

from ._names import DL4JEnum, as_enum, with_snake_aliases

__all__ = ["EpochTerminationCondition", "IterationTerminationCondition", "MaxEpochsTerminationCondition",
           "ScoreImprovementEpochTerminationCondition", "BestScoreEpochTerminationCondition", "TimeUnit",
           "MaxTimeIterationTerminationCondition", "MaxScoreIterationTerminationCondition",
           "InvalidScoreIterationTerminationCondition"]


def _positive_int(what, n):
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {n!r}")
    return n


# -- termination conditions ---------------------------------------------------------------
class EpochTerminationCondition:
    """DL4J's ``EpochTerminationCondition``: ``terminate(epochNum, score, minimize)`` after each
    evaluated epoch (``epochNum`` counts from 0)."""

    def initialize(self) -> None:
        """Called once when a fit starts."""

    def terminate(self, epochNum: int, score: float, minimize: bool = True) -> bool:
        raise NotImplementedError


@with_snake_aliases
class MaxEpochsTerminationCondition(EpochTerminationCondition):
    """Stop after ``maxEpochs`` epochs."""

    def __init__(self, maxEpochs: int):
        self.max_epochs = _positive_int("MaxEpochsTerminationCondition's maxEpochs", maxEpochs)

    def terminate(self, epochNum, score, minimize=True):
        return epochNum + 1 >= self.max_epochs

    def __str__(self):
        return f"MaxEpochsTerminationCondition({self.max_epochs})"


@with_snake_aliases
class ScoreImprovementEpochTerminationCondition(EpochTerminationCondition):
    """Stop when the score has not improved by more than ``minImprovement`` for
    ``maxEpochsWithNoImprovement`` epochs after the best one."""

    def __init__(self, maxEpochsWithNoImprovement: int, minImprovement: float = 0.0):
        self.max_no_improvement = _positive_int("ScoreImprovementEpochTerminationCondition's "
                                                "maxEpochsWithNoImprovement", maxEpochsWithNoImprovement)
        if not isinstance(minImprovement, (int, float)) or isinstance(minImprovement, bool) or minImprovement < 0:
            raise ValueError(f"minImprovement must be a number >= 0, got {minImprovement!r}")
        self.min_improvement = float(minImprovement)
        self.initialize()

    def initialize(self):
        self.best_epoch, self.best_score = -1, math.nan

    def terminate(self, epochNum, score, minimize=True):
        if self.best_epoch == -1:
            self.best_epoch, self.best_score = epochNum, score
            return False
        improvement = (self.best_score - score) if minimize else (score - self.best_score)
        if improvement > self.min_improvement:
            self.best_epoch, self.best_score = epochNum, score
            return False
        return epochNum >= self.best_epoch + self.max_no_improvement

    def __str__(self):
        return (f"ScoreImprovementEpochTerminationCondition(maxEpochsWithNoImprovement={self.max_no_improvement}, "
                f"minImprovement={self.min_improvement})")


@with_snake_aliases
class BestScoreEpochTerminationCondition(EpochTerminationCondition):
    """Stop as soon as the score is better than ``bestExpectedScore`` (lower, or higher with
    ``lesserBetter=False``)."""

    def __init__(self, bestExpectedScore: float, lesserBetter: bool = True):
        self.best_expected, self.lesser_better = float(bestExpectedScore), bool(lesserBetter)

    def terminate(self, epochNum, score, minimize=True):
        return score < self.best_expected if self.lesser_better else score > self.best_expected

    def __str__(self):
        return f"BestScoreEpochTerminationCondition({self.best_expected})"


class TimeUnit(DL4JEnum):
    """Java's ``TimeUnit``, for :class:`MaxTimeIterationTerminationCondition`."""

    NANOSECONDS = "nanoseconds"
    MICROSECONDS = "microseconds"
    MILLISECONDS = "milliseconds"
    SECONDS = "seconds"
    MINUTES = "minutes"
    HOURS = "hours"
    DAYS = "days"

    def toSeconds(self, amount: float) -> float:
        """``amount`` of this unit in seconds."""
        return amount * _SECONDS[self.name]


_SECONDS = {"NANOSECONDS": 1e-9, "MICROSECONDS": 1e-6, "MILLISECONDS": 1e-3, "SECONDS": 1.0, "MINUTES": 60.0,
            "HOURS": 3600.0, "DAYS": 86400.0}


class IterationTerminationCondition:
    """DL4J's ``IterationTerminationCondition``: ``terminate(lastMiniBatchScore)`` per iteration."""

    def initialize(self) -> None:
        """Called once when a fit starts."""

    def terminate(self, lastMiniBatchScore: float) -> bool:
        raise NotImplementedError


@with_snake_aliases
class MaxTimeIterationTerminationCondition(IterationTerminationCondition):
    """Stop once ``maxTimeAmount`` ``timeUnit`` (a :class:`TimeUnit` or its name) have passed since
    the fit started."""

    def __init__(self, maxTimeAmount: float, timeUnit="SECONDS"):
        if isinstance(maxTimeAmount, bool) or not isinstance(maxTimeAmount, (int, float)) or maxTimeAmount <= 0:
            raise ValueError(f"maxTimeAmount must be a number > 0, got {maxTimeAmount!r}")
        self.unit = as_enum(TimeUnit, timeUnit, "timeUnit")
        self.max_seconds = self.unit.toSeconds(maxTimeAmount)
        self.initialize()

    def initialize(self):
        self.end = time.monotonic() + self.max_seconds

    def terminate(self, lastMiniBatchScore):
        return time.monotonic() >= self.end

    def __str__(self):
        return f"MaxTimeIterationTerminationCondition({self.max_seconds * 1000:.0f}ms)"


@with_snake_aliases
class MaxScoreIterationTerminationCondition(IterationTerminationCondition):
    """Stop when a minibatch's score exceeds ``maxScore`` (or is NaN)."""

    def __init__(self, maxScore: float):
        self.max_score = float(maxScore)

    def terminate(self, lastMiniBatchScore):
        return math.isnan(lastMiniBatchScore) or lastMiniBatchScore > self.max_score

    def __str__(self):
        return f"MaxScoreIterationTerminationCondition({self.max_score})"


@with_snake_aliases
class InvalidScoreIterationTerminationCondition(IterationTerminationCondition):
    """Stop when a minibatch's score is NaN or infinite."""

    def terminate(self, lastMiniBatchScore):
        return not math.isfinite(lastMiniBatchScore)

    def __str__(self):
        return "InvalidScoreIterationTerminationCondition()"
