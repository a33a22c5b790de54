"""``@record`` (k3launch.util.records) behaves as ``@dataclass(frozen=True)``: each check runs on a
record and on its frozen-dataclass twin, and the two must agree."""

from __future__ import annotations

import copy
import dataclasses
import functools
import pickle
from typing import Any

import pytest

from k3launch.util.records import record


def _pair() -> tuple[type[Any], type[Any]]:
    def body(ns: dict[str, Any]) -> None:
        ns["__annotations__"] = {"name": "str", "size": "int", "tags": "tuple[object, ...]", "note": "str", "cache": "int"}
        ns["tags"] = dataclasses.field(default_factory=tuple)
        ns["note"] = dataclasses.field(default="", compare=False, repr=False)
        ns["cache"] = dataclasses.field(default=0, hash=False)
        ns["size"] = 1

    def post_init(self: Any) -> None:
        object.__setattr__(self, "name", self.name.strip())  # what a frozen __post_init__ does

    def doubled(self: Any) -> int:
        return 2 * self.size

    made = []
    for deco in (record, dataclasses.dataclass(frozen=True)):
        ns: dict[str, Any] = {"__post_init__": post_init, "doubled": functools.cached_property(doubled)}
        body(ns)
        cls = type("Item", (), ns)
        cls.doubled.__set_name__(cls, "doubled")
        made.append(deco(cls))
    return made[0], made[1]


REC, DC = _pair()


def _both(fn: Any) -> tuple[Any, Any]:
    out = []
    for cls in (REC, DC):
        try:
            got = fn(cls)
            out.append(("ok", repr(got) if isinstance(got, cls) else got))
        except Exception as exc:  # the same exception type and words
            out.append((type(exc).__name__, str(exc)))
    return out[0], out[1]


@pytest.mark.parametrize("check", [
    lambda c: c(" a ", 2, ("x",)).name,  # __post_init__ through object.__setattr__
    lambda c: c("a") == c("a", 1, ()),
    lambda c: c("a", note="one") == c("a", note="two"),  # compare=False
    lambda c: c("a") == c("b"),
    lambda c: c("a") != c("a", 2),
    lambda c: c("a").__eq__(("a", 1)),  # another type: NotImplemented
    lambda c: hash(c("a", cache=1)) == hash(c("a", cache=2)),  # hash=False
    lambda c: hash(c("a", 2, ("x",))) == hash(("a", 2, ("x",))),  # the hash of the compared, hashed fields
    lambda c: hash(c("a", 2, (["unhashable"],))),
    lambda c: repr(c("a", 2, ("x",), "hidden", 3)).replace(c.__qualname__, "Item"),
    lambda c: setattr(c("a"), "size", 3),
    lambda c: setattr(c("a"), "other", 3),
    lambda c: delattr(c("a"), "size"),
    lambda c: dataclasses.replace(c("a", 2), size=5),
    lambda c: [f.name for f in dataclasses.fields(c)],
    lambda c: dataclasses.asdict(c("a", 2, ("x",))),
    lambda c: dataclasses.is_dataclass(c("a")),
    lambda c: pickle.loads(pickle.dumps(c("a", 2, ("x",)))) == c("a", 2, ("x",)),
    lambda c: copy.deepcopy(c("a", 2, ("x",))) == c("a", 2, ("x",)),
    lambda c: c("a", 4).doubled,  # a cached_property stores past the frozen __setattr__
    lambda c: c.__match_args__,
    lambda c: c("a") < c("b"),  # no order, as the dataclass's
    lambda c: c(),  # a missing argument
    lambda c: {c("a"), c("a"), c("b")} == {c("a"), c("b")},
], ids=lambda fn: "")
def test_a_record_behaves_as_a_frozen_dataclass(check: Any) -> None:
    rec, dc = _both(check)
    assert rec == dc


def test_the_hash_is_the_frozen_dataclass_s() -> None:
    assert hash(REC("a", 2, cache=7)) == hash(DC("a", 2, cache=7))


def test_a_record_refuses_to_define_what_it_shares() -> None:
    class Own:
        x: int

        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = object.__hash__

    with pytest.raises(TypeError, match="defines __eq__"):
        record(Own)


def test_a_recursive_repr_does_not_recurse() -> None:
    tags: list[object] = []
    item = REC("a", 1, (tags,))
    tags.append(item)
    assert repr(item) == "Item(name='a', size=1, tags=([...],), cache=0)"
