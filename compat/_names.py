"""camelCase and snake_case: DL4J's method names, their Python aliases, and errors for unknown ones."""

from __future__ import annotations

import difflib
import enum
import re

__all__ = ["snake", "with_snake_aliases", "unknown_name", "Builder", "as_enum", "DL4JEnum"]


def snake(name: str) -> str:
    """``batchSizePerWorker`` -> ``batch_size_per_worker``, ``evaluateROC`` -> ``evaluate_roc``."""
    s = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", s).lower()


def with_snake_aliases(cls):
    """Class decorator: every public camelCase method also answers to its snake_case name."""
    for name, value in list(vars(cls).items()):
        alias = snake(name)
        method = callable(value) or isinstance(value, (staticmethod, classmethod))
        if method and not name.startswith("_") and alias != name and alias not in vars(cls):
            setattr(cls, alias, value)
    return cls


def _public(obj) -> list:
    return sorted(n for n in dir(type(obj)) if not n.startswith("_"))


def unknown_name(owner: str, name: str, known) -> AttributeError:
    """The error for a method ``owner`` lacks, naming the closest known ones (or, if none is
    close, every known one)."""
    known = list(known)
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    if not close:
        close = difflib.get_close_matches(snake(name), known, n=3, cutoff=0.5)
    if close:
        return AttributeError(f"{owner} has no method {name!r}; closest known: {', '.join(close)}")
    aliases = {snake(k) for k in known if snake(k) != k}  # listed once, under their DL4J name
    listing = ", ".join(k for k in known if k not in aliases)
    return AttributeError(f"{owner} has no method {name!r}; known: {listing}")


class Builder:
    """Base of the DL4J-shaped builders: methods set a value and return the builder.

    An unknown method raises an ``AttributeError`` naming the closest known ones.
    """

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        raise unknown_name(type(self).__qualname__, name, _public(self))


def as_enum(kind: type, value, what: str):
    """``value`` as a member of the enum ``kind`` (a member, or its name or value as a string)."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        for member in kind:
            if value in (member.name, member.value) or value.lower() in (member.name.lower(), member.value):
                return member
    allowed = ", ".join(f"{kind.__name__}.{m.name}" for m in kind)
    raise ValueError(f"{what} must be one of {allowed}, got {value!r}")


class DL4JEnum(enum.Enum):
    """An enum whose members print as DL4J writes them (``RDDTrainingApproach.Export``)."""

    def __repr__(self):
        return f"{type(self).__name__}.{self.name}"
