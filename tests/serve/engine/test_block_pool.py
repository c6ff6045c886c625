"""The block pool: reference counts, the prefix cache and its eviction, the audit."""

from __future__ import annotations

import pytest

from kiln.errors import KilnError
from kiln.serve.engine.block_pool import BlockPool, block_keys
from tests.model.helpers import llama_small


def pool(n: int) -> BlockPool:
    return BlockPool(llama_small(), n, 4)


def test_shared_blocks_return_to_the_cache_and_are_evicted_oldest_first() -> None:
    p = pool(3)
    keys = block_keys(list(range(8)), 4, 2)
    a, b = p.allocate(), p.allocate()
    p.register(a, keys[0])
    p.register(b, keys[1])
    assert p.lookup(keys) == [a, b]
    p.retain(a)  # a second sequence shares the first block
    p.release([a, b])
    assert (p.used, p.cached, p.available) == (2, 1, 2)  # b idle in the cache, a still held
    p.audit([[a]])
    p.release([a])
    assert p.cached == 2
    c = p.allocate()  # the free block first
    d = p.allocate()  # then the least recently released cached block: b
    assert d == b and p.lookup(keys) == [a]
    with pytest.raises(KilnError, match="exhausted"):
        p.allocate(), p.allocate()
    p.release([c, d, a])
    p.audit([])


def test_the_audit_finds_a_leak() -> None:
    p = pool(2)
    p.allocate()
    with pytest.raises(AssertionError, match="holds counted"):
        p.audit([])


def test_keys_chain_the_whole_prefix() -> None:
    one = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    other = block_keys([9, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    assert one[1][1] == other[1][1] and one[1] != other[1]  # same tokens, different prefix
