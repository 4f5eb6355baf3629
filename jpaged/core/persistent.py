"""Persistent (immutable, structure-sharing) tables and queues for the block manager's snapshots.

A `Table` is a map split into dict *shards*: key k lives in shard `(hash(k) >> bits) % num_shards`,
so 2**bits consecutive ints (block ids, queue positions) share a shard, and a table sized for
`capacity` keys has about `capacity / 2**bits` shards. A `Table` is never mutated. An operation
takes a `TableEdit` (`table.edit()`), which copies the tuple of shards on its first write and each
shard on that shard's first write, then `freeze()`s into a new `Table` that shares every untouched
shard with the old one. One operation costs O(capacity / 2**bits + 2**bits * shards written), not
O(capacity): the snapshots stay cheap at hundreds of sequences, and old snapshots stay valid.

A `Queue` is a FIFO of ints with removal by value, built from two tables (position -> item and
item -> position); positions only grow, and a removed item leaves a gap that `popleft` skips.

Measured against the `immutables` package (a C HAMT) on `bench/scheduler_overhead.py`: see
`bench/README.md` ("Persistent tables").
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

SHARD_BITS = 5  # 32 consecutive keys a shard


class Table:
    """An immutable map of `Hashable -> value`, stored as dict shards (see the module docstring)."""

    __slots__ = ("shards", "bits")

    def __init__(self, shards: tuple[dict, ...], bits: int):
        self.shards, self.bits = shards, bits

    @classmethod
    def empty(cls, capacity: int, bits: int = SHARD_BITS) -> Table:
        """An empty table laid out for about `capacity` keys (every shard is one shared empty dict:
        an edit copies a shard before writing to it)."""
        return cls(({},) * ((capacity >> bits) + 1), bits)

    def shard_index(self, key) -> int:
        return (hash(key) >> self.bits) % len(self.shards)

    def get(self, key, default=None):
        return self.shards[self.shard_index(key)].get(key, default)

    def __contains__(self, key) -> bool:
        return key in self.shards[self.shard_index(key)]

    def __iter__(self):
        return (key for shard in self.shards for key in shard)

    def __len__(self) -> int:
        """Keys in the table: O(shards), not O(keys)."""
        return sum(map(len, self.shards))

    def to_dict(self) -> dict:
        """The whole table as one dict (O(capacity)), checking that every key sits in its shard."""
        merged = {}
        for i, shard in enumerate(self.shards):
            assert all(self.shard_index(k) == i for k in shard), "table key in the wrong shard"
            merged.update(shard)
        return merged

    def edit(self) -> TableEdit:
        return TableEdit(self)

    def __eq__(self, other) -> bool:
        return isinstance(other, Table) and self.bits == other.bits and self.shards == other.shards

    __hash__ = None  # dict shards: unhashable, like the dicts they are

    def __reduce__(self):  # copy / pickle (slots, no __dict__)
        return Table, (self.shards, self.bits)


class TableEdit:
    """A working copy of a `Table` for one operation, dict-like. Reads see the table's shards until
    a write copies the shard it touches; `freeze()` returns the new `Table` (the old one if nothing
    was written)."""

    __slots__ = ("table", "shards", "copied")

    def __init__(self, table: Table):
        self.table, self.shards, self.copied = table, table.shards, None

    def get(self, key, default=None):
        return self.shards[self.table.shard_index(key)].get(key, default)

    def __contains__(self, key) -> bool:
        return key in self.shards[self.table.shard_index(key)]

    def __getitem__(self, key):
        return self.shards[self.table.shard_index(key)][key]

    def writable_shard(self, key) -> dict:
        """The shard dict that holds `key`, copied for writing (once per operation): a batch of reads
        and writes of its keys may go to it directly, one shard lookup a key instead of two."""
        return self._writable(key)

    def _writable(self, key) -> dict:
        i = self.table.shard_index(key)
        if self.copied is None:
            self.shards, self.copied = list(self.shards), set()
        if i not in self.copied:
            self.shards[i] = dict(self.shards[i])
            self.copied.add(i)
        return self.shards[i]

    def __setitem__(self, key, value) -> None:
        self._writable(key)[key] = value

    def __delitem__(self, key) -> None:
        del self._writable(key)[key]

    def pop(self, key):
        return self._writable(key).pop(key)

    def freeze(self) -> Table:
        return self.table if self.copied is None else Table(tuple(self.shards), self.table.bits)


class Queue(NamedTuple):
    """An immutable FIFO of ints with removal by value: `items` (position -> item) and `index`
    (item -> position); positions only grow, a removed item leaves a gap."""

    items: Table
    index: Table
    head: int  # position of the front (or of a gap before it)
    tail: int  # position the next item goes to
    size: int

    @classmethod
    def of(cls, items: Iterable[int], capacity: int, bits: int = SHARD_BITS) -> Queue:
        empty = Table.empty(capacity, bits)
        edit = cls(empty, empty, 0, 0, 0).edit()
        for item in items:
            edit.append(item)
        return edit.freeze()

    def to_tuple(self, check: bool = False) -> tuple[int, ...]:
        """Front to back (O(tail - head)). `check` asserts that both tables agree."""
        order = tuple(item for p in range(self.head, self.tail) if (item := self.items.get(p)) is not None)
        if check:
            index = self.index.to_dict()
            assert len(order) == self.size == len(index) == len(self.items.to_dict()), (
                f"queue of {self.size}: {len(order)} in order, {len(index)} indexed")
            assert all(self.items.get(p) == item for item, p in index.items()), "bad queue index"
        return order

    def edit(self) -> QueueEdit:
        return QueueEdit(self)


class QueueEdit:
    """A working copy of a `Queue` for one operation."""

    __slots__ = ("items", "index", "head", "tail", "size")

    def __init__(self, queue: Queue):
        self.items, self.index = queue.items.edit(), queue.index.edit()
        self.head, self.tail, self.size = queue.head, queue.tail, queue.size

    def __len__(self) -> int:
        return self.size

    def append(self, item: int) -> None:
        self.items[self.tail], self.index[item] = item, self.tail
        self.tail, self.size = self.tail + 1, self.size + 1

    def popleft(self) -> int:
        while self.head not in self.items:  # skip the gaps of removed items
            self.head += 1
        item = self.items.pop(self.head)
        del self.index[item]
        self.head, self.size = self.head + 1, self.size - 1
        return item

    def remove(self, item: int) -> None:
        del self.items[self.index.pop(item)]
        self.size -= 1

    def freeze(self) -> Queue:
        return Queue(self.items.freeze(), self.index.freeze(), self.head, self.tail, self.size)
