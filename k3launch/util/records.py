"""Frozen records: the classes ``@dataclass(frozen=True)`` makes, for a fraction of its import cost.

``dataclass`` writes each method it adds as source text and compiles it when the class is defined,
at every start: for a frozen class six of them (``__init__``, ``__repr__``, ``__eq__``,
``__hash__``, ``__setattr__``, ``__delattr__``), about 0.5 ms a class on the development machine.
Planning defines some thirty frozen classes on the way to every ``plan``: compiling their methods
was the largest part of what ``plan --json`` spends beyond the Typer floor (docs/development.md,
"Start-up time").

``@record`` has ``dataclass`` write ``__init__`` alone (keyword names, defaults and factories,
``__post_init__`` as before) and gives every record the same five other methods, which read the
class's fields when called. A record behaves as the frozen dataclass: equal and hashed by its
fields (those ``field(compare=...)``/``hash=`` keep), the same repr, ``FrozenInstanceError`` on
assigning or deleting an attribute after ``__init__`` (``object.__setattr__`` still sets one, as
``__post_init__`` does), and ``dataclasses.replace``, ``fields``, ``asdict`` work on it;
tests/fast/test_records.py checks each against a frozen dataclass.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass, fields
from reprlib import recursive_repr
from typing import Any, TypeVar, cast, dataclass_transform

T = TypeVar("T")


def _values(self: Any, names: tuple[str, ...]) -> tuple[Any, ...]:
    return tuple(getattr(self, name) for name in names)


def _eq(self: Any, other: Any) -> Any:
    if other.__class__ is self.__class__:
        names = self.__record_compare__
        return _values(self, names) == _values(other, names)
    return NotImplemented


def _hash(self: Any) -> int:
    return hash(_values(self, self.__record_hash__))


@recursive_repr()
def _repr(self: Any) -> str:
    return f"{type(self).__qualname__}(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__record_repr__) + ")"


def _setattr(self: Any, name: str, value: object) -> None:
    # ``__init__`` sets each field once, through here; anything after that is refused
    if name in self.__record_fields__ and name not in self.__dict__:
        object.__setattr__(self, name, value)
        return
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _delattr(self: Any, name: str) -> None:
    raise FrozenInstanceError(f"cannot delete field {name!r}")


@dataclass_transform(frozen_default=True)
def record(cls: type[T]) -> type[T]:
    """``@dataclass(frozen=True)``, with the methods other than ``__init__`` shared."""
    for name in ("__setattr__", "__delattr__", "__eq__", "__hash__", "__repr__"):
        if name in cls.__dict__:
            raise TypeError(f"{cls.__qualname__} defines {name}: a record's is its fields'")
    made: Any = dataclass(eq=False, repr=False)(cls)
    fs = fields(made)
    made.__record_fields__ = frozenset(f.name for f in fs)
    made.__record_compare__ = tuple(f.name for f in fs if f.compare)
    made.__record_hash__ = tuple(f.name for f in fs if (f.compare if f.hash is None else f.hash))
    made.__record_repr__ = tuple(f.name for f in fs if f.repr)
    made.__eq__, made.__hash__, made.__repr__ = _eq, _hash, _repr
    made.__setattr__, made.__delattr__ = _setattr, _delattr
    return cast("type[T]", made)
