"""Argument checks shared across layers, with errors that name the parameter and the value.

Here, below every runtime and algorithm, so that a runtime checks its arguments
without importing an algorithm module.
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["positive_int"]


def positive_int(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int, checked to be an integer (numpy's too, not a bool) >= ``minimum``.

    Raises
    ------
    ValueError
        Naming ``name``, the value received and the bound, e.g.
        ``epochs must be an integer >= 1, got 0``.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
