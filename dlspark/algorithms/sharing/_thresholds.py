"""Threshold algorithms and residual post-processors, as optax-style (init, update) pairs.

Each factory returns an object with pure ``init() -> state`` and
``update(state, sparsity) -> state`` (thresholds) or
``update(residual, threshold, iteration) -> residual`` (post-processors);
states are NamedTuples. Names, defaults and meanings follow DL4J's
``AdaptiveThresholdAlgorithm``, ``TargetSparsityThresholdAlgorithm``,
``FixedThresholdAlgorithm`` and ``ResidualClippingPostProcessor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["ThresholdState", "AdaptiveThreshold", "TargetSparsityThreshold", "FixedThreshold",
           "ResidualClipping", "NoResidualPostProcessing", "DEFAULT_DECAY"]

#: DL4J's default decay: the threshold halves (or doubles) over 20 steps.
DEFAULT_DECAY = 0.5 ** (1 / 20)


class ThresholdState(NamedTuple):
    """The current threshold and the sparsity last seen."""

    threshold: float
    last_sparsity: float = float("nan")


def _check_threshold(name, value):
    if not (isinstance(value, (int, float)) and np.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _check_decay(decay):
    if not (isinstance(decay, (int, float)) and 0.5 <= decay < 1.0):
        raise ValueError(f"decay must be in [0.5, 1), got {decay!r}")


def _steer(state, sparsity, low, high, decay):
    """Lower the threshold (more elements sent) below ``low``, raise it above ``high``."""
    t = state.threshold
    if sparsity < low:
        t *= decay
    elif sparsity > high:
        t /= decay
    return ThresholdState(t, float(sparsity))


class _Threshold:
    def init(self) -> ThresholdState:
        return ThresholdState(float(self.initial))

    def reduce(self, states) -> ThresholdState:
        """Combine the workers' states at the end of a fit: the mean threshold (as DL4J's reducers)."""
        states = list(states)
        if not states:
            return self.init()
        return ThresholdState(float(np.mean([s.threshold for s in states])),
                              float(np.nanmean([s.last_sparsity for s in states])) if any(
                                  np.isfinite(s.last_sparsity) for s in states) else float("nan"))


@dataclass(frozen=True)
class AdaptiveThreshold(_Threshold):
    """Keep each step's sparsity within ``[min_sparsity, max_sparsity]``.

    Below the band the threshold is lowered (multiplied by ``decay``), above
    it raised (divided by ``decay``). A step sent as a dense bitmap counts as
    sparsity 1/16.
    """

    initial: float = 1e-4
    min_sparsity: float = 1e-4
    max_sparsity: float = 1e-2
    decay: float = DEFAULT_DECAY

    def __post_init__(self):
        _check_threshold("initial", self.initial)
        _check_decay(self.decay)
        if not (0 < self.min_sparsity < self.max_sparsity <= 1.0 / 16):
            raise ValueError(
                f"need 0 < min_sparsity < max_sparsity <= 1/16, got min_sparsity={self.min_sparsity!r}, "
                f"max_sparsity={self.max_sparsity!r}"
            )

    def update(self, state: ThresholdState, sparsity: float) -> ThresholdState:
        return _steer(state, sparsity, self.min_sparsity, self.max_sparsity, self.decay)


@dataclass(frozen=True)
class TargetSparsityThreshold(_Threshold):
    """Steer each step's sparsity toward ``target``: lower the threshold below it, raise it above."""

    initial: float = 1e-4
    target: float = 1e-3
    decay: float = DEFAULT_DECAY

    def __post_init__(self):
        _check_threshold("initial", self.initial)
        _check_decay(self.decay)
        if not (0 < self.target < 1.0 / 16):
            raise ValueError(f"target must be in (0, 1/16), got {self.target!r}")

    def update(self, state: ThresholdState, sparsity: float) -> ThresholdState:
        return _steer(state, sparsity, self.target, self.target, self.decay)


@dataclass(frozen=True)
class FixedThreshold(_Threshold):
    """A constant threshold."""

    initial: float = 1e-3

    def __post_init__(self):
        _check_threshold("threshold", self.initial)

    def update(self, state: ThresholdState, sparsity: float) -> ThresholdState:
        return ThresholdState(state.threshold, float(sparsity))


@dataclass(frozen=True)
class ResidualClipping:
    """Every ``frequency`` iterations clip the residual to ``±threshold_multiple * threshold``."""

    threshold_multiple: float = 5.0
    frequency: int = 5

    def __post_init__(self):
        if not (isinstance(self.threshold_multiple, (int, float)) and self.threshold_multiple > 0):
            raise ValueError(f"threshold_multiple must be positive, got {self.threshold_multiple!r}")
        if isinstance(self.frequency, bool) or not isinstance(self.frequency, int) or self.frequency < 1:
            raise ValueError(f"frequency must be an integer >= 1, got {self.frequency!r}")

    def update(self, residual: np.ndarray, threshold: float, iteration: int) -> np.ndarray:
        if iteration % self.frequency == 0:
            lim = np.float32(self.threshold_multiple * threshold)
            np.clip(residual, -lim, lim, out=residual)
        return residual


@dataclass(frozen=True)
class NoResidualPostProcessing:
    """Leave the residual as it is."""

    def update(self, residual: np.ndarray, threshold: float, iteration: int) -> np.ndarray:
        return residual
