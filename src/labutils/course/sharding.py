"""Which rank saw which item: ownership tables from the ranks' records, and coverage.

Lesson 04's scripts report, per rank and epoch, the dataset indices the rank
trained on. These helpers turn those records into {epoch: {rank: [items]}} and
check an epoch the way a correct data-parallel epoch must look: every item seen
exactly once, by exactly one rank::

    from labutils.course.sharding import ownership, coverage
    own = ownership(result.records, setup="correct")   # {epoch: {rank: [items]}}
    coverage(own[0], n_items=10)                        # Coverage(missing=[], duplicated={}, ...)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from labutils.errors import InputError, whole_number

__all__ = ["ownership", "Coverage", "coverage"]


def ownership(records: Iterable[dict], *, key: str = "items", **match) -> dict[int, dict[int, list[int]]]:
    """{epoch: {rank: items}} from records that carry "epoch", "rank" and key.

    Args:
        records: result.records of a run.
        key: the name under which ranks reported their list of indices.
        **match: only records whose values equal these (e.g. setup="correct").
    """
    table: dict[int, dict[int, list[int]]] = {}
    for rec in records:
        if key not in rec or any(rec.get(k) != v for k, v in match.items()):
            continue
        if "epoch" not in rec or "rank" not in rec:
            raise InputError("records", expected=f"records with 'epoch', 'rank' and {key!r}",
                             given=sorted(rec), fix="report(epoch=epoch, items=[...]) in every rank")
        table.setdefault(int(rec["epoch"]), {})[int(rec["rank"])] = [int(i) for i in rec[key]]
    return {e: dict(sorted(table[e].items())) for e in sorted(table)}


@dataclass
class Coverage:
    """How one epoch's shards cover a dataset of n_items.

    seen: items seen (with repeats); missing: items no rank saw; duplicated: item ->
    how many times it was seen, for items seen more than once.
    """

    n_items: int
    seen: int
    missing: list[int] = field(default_factory=list)
    duplicated: dict[int, int] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        """Every item seen exactly once."""
        return not self.missing and not self.duplicated and self.seen == self.n_items

    def __str__(self) -> str:
        if self.exact:
            return f"every one of the {self.n_items} items seen exactly once"
        parts = [f"{self.seen} items seen for {self.n_items} in the dataset"]
        counts = set(self.duplicated.values())
        if not self.missing and len(self.duplicated) == self.n_items and len(counts) == 1:
            return f"{parts[0]}: every item {counts.pop()} times"
        if self.missing:
            parts.append(f"missing {self.missing}")
        if self.duplicated:
            parts.append("seen more than once " + ", ".join(f"{i} ({n}x)" for i, n in self.duplicated.items()))
        return "; ".join(parts)


def coverage(shards: Mapping[int, Sequence[int]], *, n_items: int) -> Coverage:
    """Check one epoch: which items were missed and which were seen more than once.

    Args:
        shards: {rank: items that rank saw in the epoch}.
        n_items: the dataset's length; items are 0 .. n_items-1.
    """
    if not whole_number(n_items) or n_items < 0:
        raise InputError("n_items", expected="a whole number >= 0", given=n_items,
                         fix="pass len(dataset)")
    if not isinstance(shards, Mapping):
        raise InputError("shards", expected="a dict {rank: [items]}", given=shards,
                         fix="pass one epoch of ownership(...), e.g. own[0]")
    counts: Counter = Counter()
    for rank, items in shards.items():
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise InputError(f"shards[{rank!r}]", expected="a list of item indices", given=items,
                             fix="pass the indices the rank saw")
        for i in items:
            if not whole_number(i) or not 0 <= i < n_items:
                raise InputError(f"shards[{rank!r}]", expected=f"indices in 0..{n_items - 1}",
                                 given=list(items), fix="check n_items against the dataset")
        counts.update(items)
    return Coverage(
        n_items=n_items, seen=sum(counts.values()),
        missing=[i for i in range(n_items) if counts[i] == 0],
        duplicated={i: n for i, n in sorted(counts.items()) if n > 1},
    )
