"""Members: an immutable set of learner ids that grows by one in O(1).

A round's contributors (`rules.RoundState.contributors`) are a value, replaced whole at
every push, so that a reader without the fragment's lock (`Shard.due_in`) sees one round
or the next, never half of one. As a frozenset, adding the n-th contributor copied n ids:
a round of n learners cost O(n²). A `Members` view is a prefix of a log shared by every
view of one lineage: growing the newest view appends to the log and returns a longer
prefix, leaving the older view as it was; growing an older view (a branch) copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Set


class Members(Set[str]):
    """An immutable set of ids; `with_(m)` returns it with m added (O(1) on the newest view).

    Example:
      >>> a = Members(["x"]); b = a.with_("y")
      >>> sorted(a), sorted(b), b.added_since(a)
      (['x'], ['x', 'y'], 'y')
    """

    __slots__ = ("_order", "_index", "_n")

    def __init__(self, items: Iterable[str] = ()):
        self._order: list[str] = []
        self._index: dict[str, int] = {}
        for m in items:
            if m not in self._index:
                self._index[m] = len(self._order)
                self._order.append(m)
        self._n = len(self._order)

    @classmethod
    def _prefix(cls, order: list[str], index: dict[str, int], n: int) -> Members:
        view = cls.__new__(cls)
        view._order, view._index, view._n = order, index, n
        return view

    def __contains__(self, m: object) -> bool:
        i = self._index.get(m) if isinstance(m, str) else None
        return i is not None and i < self._n

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[str]:
        return iter(self._order[: self._n])

    def __repr__(self) -> str:
        return f"Members({self._order[: self._n]!r})"

    __hash__ = Set._hash

    def with_(self, m: str) -> Members:
        """This set with `m` added; self is unchanged."""
        if m in self:
            return self
        if self._n == len(self._order):  # the newest view: the log grows, older prefixes stay
            self._index[m] = self._n
            self._order.append(m)
            return Members._prefix(self._order, self._index, self._n + 1)
        return Members([*self, m])

    def added_since(self, older: Set[str]) -> str | None:
        """The one id this set holds beyond `older` when it is `older` grown by one (O(1));
        None when that cannot be told cheaply (the caller then compares whole sets)."""
        if isinstance(older, Members) and older._order is self._order:
            return self._order[older._n] if self._n == older._n + 1 else None
        if not older and self._n == 1:
            return self._order[0]
        return None
