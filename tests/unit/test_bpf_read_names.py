"""``maps.joined``: two reads of one hash map as one (the names map is read around the service map, so a service
removed by a sync between the two reads keeps its name in a read beside that sync)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kproxy.backends.bpf import maps


def raw(entries: dict[int, bytes]) -> tuple[bytes, bytes]:
    return b"".join(k.to_bytes(4, "little") for k in entries), b"".join(entries.values())


def test_a_key_of_either_read_is_kept_and_the_later_value_wins() -> None:
    before = {1: b"a" * 8, 2: b"b" * 8}
    after = {2: b"B" * 8, 3: b"c" * 8}
    keys, values = maps.joined(raw(before), raw(after), 4, 8)
    got = {int.from_bytes(keys[i : i + 4], "little"): values[2 * i : 2 * i + 8] for i in range(0, len(keys), 4)}
    assert got == {1: b"a" * 8, 2: b"B" * 8, 3: b"c" * 8}


@given(st.dictionaries(st.integers(0, 2**32 - 1), st.binary(min_size=8, max_size=8), max_size=30))
def test_two_equal_reads_join_to_the_same_read(entries: dict[int, bytes]) -> None:
    assert maps.joined(raw(entries), raw(entries), 4, 8) == raw(entries)
