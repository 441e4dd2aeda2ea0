"""Threshold algorithms and residual post-processors, as optax-style (init, update) pairs.

Each factory returns an object with pure ``init() -> state``,
``prepare(state, residual) -> state`` (the threshold a step encodes with: where
``initial`` is None, the first ``warmup`` steps take it from the residual) and
``update(state, sparsity) -> state`` (thresholds) or
``update(residual, threshold, iteration) -> residual`` (post-processors);
states are NamedTuples. Names, defaults and meanings follow DL4J's
``AdaptiveThresholdAlgorithm``, ``TargetSparsityThresholdAlgorithm``,
``FixedThresholdAlgorithm`` and ``ResidualClippingPostProcessor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from ._encoding import threshold_sending

__all__ = ["ThresholdAlgorithm", "ResidualPostProcessor", "ThresholdState", "AdaptiveThreshold", "TargetSparsityThreshold", "FixedThreshold",
           "ResidualClipping", "NoResidualPostProcessing", "DEFAULT_DECAY"]

_clip = jax.jit(lambda r, lim: jnp.clip(r, -lim, lim))

#: DL4J's default decay: the threshold halves (or doubles) over 20 steps.
DEFAULT_DECAY = 0.5 ** (1 / 20)


class ThresholdState(NamedTuple):
    """The current threshold, the sparsity last seen and the steps taken (NaN: no threshold yet)."""

    threshold: float
    last_sparsity: float = float("nan")
    steps: int = 0


@runtime_checkable
class ThresholdAlgorithm(Protocol):
    """What gradient sharing asks of a threshold algorithm (any object with these four methods).

    Each method is pure: it returns a new :class:`ThresholdState` and changes nothing.
    ``init`` starts a replica; ``prepare`` gives the threshold that encodes this step's
    residual (after the update was added; an algorithm may also provide
    ``known_threshold(state)``, the threshold ``prepare`` gives whatever the residual, or None,
    which lets a step add its update and find what crosses in one pass over the residual);
    ``update`` moves it after the step, told the
    sparsity sent (a dense bitmap counts as 1/16, an empty message as 0); ``reduce``
    combines the replicas' states at the end of a fit into the one carried to the next.
    Its ``repr`` names it in checkpoints (a resumed fit goes on from the thresholds
    reached only with an equal ``repr``).
    """

    def init(self) -> ThresholdState: ...

    def prepare(self, state: ThresholdState, residual: np.ndarray) -> ThresholdState: ...

    def update(self, state: ThresholdState, sparsity: float) -> ThresholdState: ...

    def reduce(self, states: Sequence[ThresholdState]) -> ThresholdState: ...


@runtime_checkable
class ResidualPostProcessor(Protocol):
    """What gradient sharing asks of a residual post-processor: ``update(residual, threshold,
    iteration) -> residual`` after each step's encoding (``iteration`` counts the replica's
    messages from 1). It may work in place on the float32 ``residual``.

    A post-processor may also provide ``update_on_device(residual, threshold, iteration)``,
    the same on a device array (jax.numpy); without it the device encoder reads the
    residual back to the host for ``update``. And ``acts_at(iteration) -> bool``: whether
    ``update`` may change the residual at that iteration (without it, any iteration may);
    under ``GradientSharing(own_update="whole")`` a replica takes what ``update`` dropped out
    of its own parameters too, and at the iterations where it does not act nothing is copied
    to find that.
    """

    def update(self, residual: np.ndarray, threshold: float, iteration: int) -> np.ndarray: ...


def threshold_meta(algorithm, states) -> dict:
    """A checkpoint's record of the thresholds reached, with the algorithm that reached them
    (``GradientSharing.resume_state`` reads it back; JSON has no NaN: a replica that has not
    stepped yet has no last sparsity)."""
    return {"algorithm": repr(algorithm),
            "states": [[x if np.isfinite(x) else None for x in st] for st in states]}


def senders(states: Sequence[ThresholdState], counters: Sequence[int]) -> list:
    """The threshold states carried out of a fit, on either runtime: those of the replicas that
    sent a message (``counters``: each replica's messages; one that trained nothing still holds
    the fit's starting threshold, which would pull the mean back), or every replica's when
    none did."""
    sent = [s for s, c in zip(states, counters) if c > 0]
    return sent or list(states)


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
    return ThresholdState(t, float(sparsity), int(state.steps) + 1)


def _check_warmup(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"warmup must be an integer >= 1 (steps), got {value!r}")


def _check_initial(value):
    if value is not None:
        _check_threshold("initial", value)


def quantile_threshold(update: np.ndarray, sparsity: float) -> float:
    """The threshold at which a fraction ``sparsity`` of ``update``'s elements reach it: the
    ``1 - sparsity`` quantile of ``|update|`` (positive), and never fewer elements than a
    message holds (:func:`~._encoding.threshold_sending`): a threshold that reaches one
    element of a small model sends nothing, and the warm-up would follow the growing residual
    up, step after step, sending nothing."""
    u = np.asarray(update, np.float32).ravel()  # read once (a device vector crosses to the host here)
    t = threshold_sending(u, int(round(sparsity * u.size)))
    if not t > 0:  # fewer than k elements moved at all: the smallest that did, or DL4J's 1e-3
        a = np.abs(u)
        moved = a[a > 0]
        t = float(moved.min()) if moved.size else 1e-3
    return t


class _Threshold:
    """What the threshold algorithms below share; each is a frozen dataclass with an
    ``initial`` threshold (``None``: found in a warm-up) and a ``warmup``."""

    initial: float | None
    warmup: int = 0

    def _first_sparsity(self) -> float:
        """The sparsity the warm-up's thresholds send (where ``initial`` is None)."""
        raise NotImplementedError

    def init(self) -> ThresholdState:
        """The starting state; its threshold is NaN where ``initial`` is None (set by :meth:`prepare`)."""
        return ThresholdState(float("nan") if self.initial is None else float(self.initial))

    def prepare(self, state: ThresholdState, residual: np.ndarray) -> ThresholdState:
        """The state whose threshold encodes ``residual`` (after the step's update was added).

        With ``initial=None``, for the first ``warmup`` steps: the threshold that sends
        the aimed-at sparsity of this residual (top-k selection, as Deep Gradient
        Compression does). Otherwise the state as it is.
        """
        if self.known_threshold(state) is not None:
            return state
        return state._replace(threshold=quantile_threshold(residual, self._first_sparsity()))

    def known_threshold(self, state: ThresholdState) -> float | None:
        """The threshold :meth:`prepare` gives from ``state`` whatever the residual, or None
        where it reads the residual (the warm-up). An optional part of the protocol: with it
        a step adds its update to the residual and finds what crosses the threshold in one
        pass."""
        if self.initial is not None or (np.isfinite(state.threshold) and state.steps >= self.warmup):
            return float(state.threshold)
        return None

    def reduce(self, states) -> ThresholdState:
        """Combine the workers' states at the end of a fit: the mean threshold (as DL4J's reducers)."""
        states = list(states)
        if not states:
            return self.init()
        ts = [s.threshold for s in states if np.isfinite(s.threshold)]
        return ThresholdState(float(np.mean(ts)) if ts else self.init().threshold,
                              float(np.nanmean([s.last_sparsity for s in states])) if any(
                                  np.isfinite(s.last_sparsity) for s in states) else float("nan"),
                              # the steps taken: a carried threshold does not warm up again
                              max(int(s.steps) for s in states))


@dataclass(frozen=True)
class AdaptiveThreshold(_Threshold):
    """Keep each step's sparsity within ``[min_sparsity, max_sparsity]``.

    Below the band the threshold is lowered (multiplied by ``decay``), above
    it raised (divided by ``decay``). A step sent as a dense bitmap counts as
    sparsity 1/16.

    ``initial=None`` (the default) warms up: for each worker's first ``warmup``
    steps the threshold is the one that sends the band's geometric middle,
    ``sqrt(min_sparsity * max_sparsity)``, of the elements of its residual, and
    never fewer than a message's 2 (it grows as the residual accumulates), so the
    band holds from the first step; from there it is steered as above. A number
    starts there instead and steers from the first step, as DL4J does (its
    documentation's 1e-3; ``dlspark.compat.AdaptiveThresholdAlgorithm`` sets it;
    ``warmup`` is then unused).
    Measured on the digits MLP with Adam(1e-3) and two workers, a start at 1e-4
    lies 6x below the first updates' mean magnitude: the first ~95 steps went out
    as dense bitmaps (62-77% of the elements moving, each by only ``±threshold``,
    the rest clipped to 5 thresholds every 5 steps) until the threshold had climbed,
    by ``1/decay`` a step, to where the band holds.
    """

    initial: float | None = None
    min_sparsity: float = 1e-4
    max_sparsity: float = 1e-2
    decay: float = DEFAULT_DECAY
    warmup: int = 20

    def __post_init__(self):
        _check_initial(self.initial)
        _check_warmup(self.warmup)
        _check_decay(self.decay)
        if not (0 < self.min_sparsity < self.max_sparsity < 1.0 / 16):
            # a step sent as a dense bitmap counts as 1/16: a band reaching it would never raise
            # the threshold out of dense steps
            raise ValueError(
                f"need 0 < min_sparsity < max_sparsity < 1/16 (a dense step counts as 1/16), got "
                f"min_sparsity={self.min_sparsity!r}, max_sparsity={self.max_sparsity!r}"
            )

    def _first_sparsity(self) -> float:
        return float(np.sqrt(self.min_sparsity * self.max_sparsity))

    def update(self, state: ThresholdState, sparsity: float) -> ThresholdState:
        return _steer(state, sparsity, self.min_sparsity, self.max_sparsity, self.decay)


@dataclass(frozen=True)
class TargetSparsityThreshold(_Threshold):
    """Steer each step's sparsity toward ``target``: lower the threshold below it, raise it above.

    ``initial=None`` (the default): for each worker's first ``warmup`` steps the
    threshold is the one that sends ``target`` of the elements of its residual,
    then it is steered from there; a number starts there instead and steers from
    the first step (DL4J's 1e-4, which ``dlspark.compat`` sets).
    """

    initial: float | None = None
    target: float = 1e-3
    decay: float = DEFAULT_DECAY
    warmup: int = 20

    def __post_init__(self):
        _check_initial(self.initial)
        _check_warmup(self.warmup)
        _check_decay(self.decay)
        if not (0 < self.target < 1.0 / 16):
            raise ValueError(f"target must be in (0, 1/16), got {self.target!r}")

    def _first_sparsity(self) -> float:
        return self.target

    def update(self, state: ThresholdState, sparsity: float) -> ThresholdState:
        return _steer(state, sparsity, self.target, self.target, self.decay)


@dataclass(frozen=True)
class FixedThreshold(_Threshold):
    """A constant threshold."""

    initial: float = 1e-3

    def __post_init__(self):
        _check_threshold("threshold", self.initial)

    def update(self, state: ThresholdState, sparsity: float) -> ThresholdState:
        return ThresholdState(state.threshold, float(sparsity), int(state.steps) + 1)


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

    def acts_at(self, iteration: int) -> bool:
        return iteration % self.frequency == 0

    def update(self, residual: np.ndarray, threshold: float, iteration: int) -> np.ndarray:
        if self.acts_at(iteration):
            lim = np.float32(self.threshold_multiple * threshold)
            np.clip(residual, -lim, lim, out=residual)
        return residual

    def update_on_device(self, residual, threshold: float, iteration: int):
        """``update`` on a device vector (the same bits: one clip of float32 values)."""
        if self.acts_at(iteration):
            return _clip(residual, np.float32(self.threshold_multiple * threshold))
        return residual


@dataclass(frozen=True)
class NoResidualPostProcessing:
    """Leave the residual as it is."""

    def acts_at(self, iteration: int) -> bool:
        return False

    def update(self, residual: np.ndarray, threshold: float, iteration: int) -> np.ndarray:
        return residual

    def update_on_device(self, residual, threshold: float, iteration: int):
        return residual
