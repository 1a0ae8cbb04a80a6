"""Block manager: allocation, ref counts, the hash-chained prefix cache and LRU reuse, and the
blocks freed behind a sliding window."""

import pytest

from nanovllm.engine.block_manager import FREED, BlockManager, block_hash
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

BS = 4


def make_seq(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=4))


def prefill(bm: BlockManager, seq: Sequence) -> int:
    """Allocate seq as the scheduler would, mark its prompt computed and publish its blocks."""
    cached = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens - len(cached) * BS, cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return len(cached) * BS


def test_allocate_and_free_counts():
    bm = BlockManager(10, BS)
    seq = make_seq(range(10))
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 7
    bm.check_invariants([seq])
    bm.free(seq)
    assert bm.num_free_blocks == 10 and seq.block_table == []
    bm.check_invariants([])


def test_allocation_fails_without_change_when_pool_is_short():
    bm = BlockManager(2, BS)
    seq = make_seq(range(12))
    assert not bm.allocate(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_prefix_hit_shares_blocks_and_keeps_last_token_uncached():
    bm = BlockManager(10, BS)
    a, b = make_seq(range(8)), make_seq(range(8))  # exactly 2 blocks
    assert prefill(bm, a) == 0
    # Only the first block may hit: the last token must still be computed.
    assert prefill(bm, b) == BS
    assert a.block_table[0] == b.block_table[0] and a.block_table[1] != b.block_table[1]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.check_invariants([a, b])


def test_hash_is_chained_over_parents():
    assert block_hash([1, 2, 3, 4], None) != block_hash([1, 2, 3, 4], block_hash([0, 0, 0, 0], None))
    bm = BlockManager(10, BS)
    prefill(bm, make_seq([9, 9, 9, 9, 1, 2, 3, 4, 5]))
    # Same second block after a different first block: no hit.
    assert bm.find_cached_prefix(make_seq([8, 8, 8, 8, 1, 2, 3, 4, 5])) == []


def test_freed_blocks_keep_hash_and_are_reused_on_hit():
    bm = BlockManager(4, BS)
    a = make_seq(range(9))
    prefill(bm, a)
    cached_ids = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = make_seq(range(9))
    assert prefill(bm, b) == 8
    assert b.block_table[:2] == cached_ids
    bm.check_invariants([b])


def test_handing_out_cached_free_block_evicts_least_recently_freed_first():
    bm = BlockManager(4, BS)
    a, b = make_seq(range(4 + 1)), make_seq(range(100, 105))
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)  # a's full block freed first...
    bm.free(b)  # ...then b's
    c = make_seq(range(200, 209))  # needs 3 blocks: the 2 unhashed ones, then the oldest cached
    assert bm.allocate(c, 9)
    assert bm.find_cached_prefix(make_seq(range(4 + 1))) == []  # a evicted
    assert bm.find_cached_prefix(make_seq(range(100, 105))) != []  # b kept
    bm.check_invariants([c])


def test_hash_collision_is_caught_by_token_compare():
    bm = BlockManager(4, BS)
    a = make_seq(range(5))
    prefill(bm, a)
    # Forge a collision: point a's hash at a block whose tokens differ.
    bm.blocks[a.block_table[0]].token_ids = (7, 7, 7, 7)
    assert bm.find_cached_prefix(make_seq(range(5))) == []


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(10, BS, enable_prefix_caching=False)
    prefill(bm, make_seq(range(9)))
    assert bm.find_cached_prefix(make_seq(range(9))) == []
    assert bm.hash_to_block == {}


def test_decode_growth_allocates_one_block_at_a_time():
    bm = BlockManager(10, BS)
    seq = make_seq(range(4))
    prefill(bm, seq)
    for token in range(5):
        seq.token_ids.append(token)
        assert bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
        bm.cache_full_blocks(seq)
    assert len(seq.block_table) == 3 and len(seq.block_hashes) == 2
    bm.check_invariants([seq])


@pytest.mark.parametrize("free_order", ["ab", "ba"])
def test_shared_block_returns_to_pool_only_when_last_holder_frees(free_order):
    bm = BlockManager(6, BS)
    seqs = {"a": make_seq(range(9)), "b": make_seq(range(9))}
    prefill(bm, seqs["a"])
    prefill(bm, seqs["b"])
    shared = seqs["a"].block_table[0]
    bm.free(seqs[free_order[0]])
    assert shared not in bm.free_blocks
    bm.free(seqs[free_order[1]])
    assert shared in bm.free_blocks
    bm.check_invariants([])


def test_blocks_that_left_every_window_go_back_to_the_pool_in_place():
    """Window 6, blocks of 4: with 17 positions computed the next query (position 17) sees 12-17,
    so blocks 0-2 (positions 0-11) are freed, their places kept as FREED and their hashes cached;
    a shared block stays with its other holder; freeing the rest later skips the FREED places."""
    bm = BlockManager(12, BS, sliding_window=6)
    a, b = make_seq(range(17)), make_seq(range(17))
    prefill(bm, a)
    prefill(bm, b)  # shares blocks 0-3 with a
    shared = a.block_table[0]
    bm.free_out_of_window(a)
    assert a.block_table[:3] == [FREED] * 3 and FREED not in a.block_table[3:]
    assert bm.blocks[shared].ref_count == 1  # still b's
    bm.check_invariants([a, b])
    bm.free_out_of_window(b)
    assert bm.blocks[shared].ref_count == 0 and bm.blocks[shared].hash is not None  # pooled, still cached
    assert bm.num_free_blocks == 12 - 2 - 1  # a's and b's last blocks, and block 3 both share
    bm.check_invariants([a, b])
    c = make_seq(range(17))
    assert prefill(bm, c) == 16  # the freed blocks still serve a prefix hit
    for seq in (a, b, c):
        bm.free(seq)
    assert bm.num_free_blocks == 12
    bm.check_invariants([])


def test_without_a_window_nothing_is_freed_early():
    bm = BlockManager(12, BS)
    a = make_seq(range(17))
    prefill(bm, a)
    table = list(a.block_table)
    bm.free_out_of_window(a)
    assert a.block_table == table
