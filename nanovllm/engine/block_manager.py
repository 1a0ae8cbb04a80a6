"""Owns the paged KV blocks: allocation, reference counts and the prefix cache.

A block's identity in the prefix cache is a hash chain: xxhash of the parent block's
hash and this block's token ids, for full blocks only. Freed blocks keep their hash, so
a later prompt with the same prefix can pick them up again; they are handed out for new
data least-recently-freed first, and handing one out evicts its hash.

For a model whose every layer attends over a sliding window (`sliding_window`), a running
sequence's blocks that left the window of every query still to come are freed as it advances
(vLLM does the same); its block table keeps their places, as FREED (-1), so that a position's
block is still table[position // block_size]. No kernel reads a key outside its window.
"""

from collections import OrderedDict

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence

FREED = -1  # a block-table entry whose block left the sliding window and went back to the pool


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to rule out hash collisions on a hit


def block_hash(token_ids, parent_hash: int | None) -> int:
    h = xxhash.xxh64()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # every layer's, or None: blocks stay until the sequence ends
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks no sequence holds, in eviction order (front goes first). Cached ones included.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached run of seq's leading full blocks.

        At most num_tokens - 1 tokens may hit, so that a fully cached prompt still computes
        its last token (the step needs logits to sample from)."""
        # Prompt logprobs, and MEAN or CLS pooling, need every prompt position computed, so such
        # a sequence never hits.
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs or seq.pools_every_position:
            return []
        hits, parent = [], None
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = block_hash(tokens, parent)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            hits.append(block_id)
            parent = h
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make seq's block table cover num_computed_tokens + num_new_tokens.

        For a sequence with no blocks yet, `cached_blocks` is its prefix-cache hit: the
        blocks are shared (ref count +1) and count as computed. Returns False, changing
        nothing, when the free pool is too small."""
        if cached_blocks:
            assert not seq.block_table, "a prefix hit only applies to a fresh sequence"
        num_tokens = seq.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens) - len(seq.block_table) - len(cached_blocks)
        # Cached blocks that sit in the free pool leave it when taken.
        taken_from_pool = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks + taken_from_pool > self.num_free_blocks:
            return False
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                # Re-using a cached free block keeps its hash.
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            # block_hashes stays a prefix of the table's chain: a block shared with a stream
            # that writes it in this very step has no hash yet, and cache_full_blocks hashes
            # the rest after the step.
            if block.hash is not None and len(seq.block_hashes) == len(seq.block_table) - 1:
                seq.block_hashes.append(block.hash)
        seq.num_computed_tokens += len(cached_blocks) * self.block_size
        for _ in range(num_new_blocks):
            block_id, _ = self.free_blocks.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                # Handing out a cached free block for new data evicts its hash.
                del self.hash_to_block[block.hash]
                block.hash = block.token_ids = None
            block.ref_count = 1
            seq.block_table.append(block_id)
        return True

    def cache_full_blocks(self, seq: Sequence):
        """Publish hashes of seq's blocks that are now full and whose KV is written.

        Called after the step that wrote them has run, never before: a hash in the map
        promises that the block's KV is valid."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = block_hash(tokens, parent)
            block = self.blocks[seq.block_table[i]]
            # An identical block may already be cached (two equal prompts in one step): keep
            # that one and leave this block unpublished.
            if h not in self.hash_to_block:
                self.hash_to_block[h] = block.block_id
                block.hash, block.token_ids = h, tuple(tokens)
            seq.block_hashes.append(h)
            parent = h

    def free(self, seq: Sequence):
        """Release seq's blocks. Tail blocks are freed first, so they are evicted before the
        prefix blocks other prompts are likelier to share; blocks holding no hash are put
        at the front, since keeping them buys nothing."""
        for block_id in reversed(seq.block_table):
            if block_id != FREED:
                self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []

    def free_tail(self, seq: Sequence):
        """Release seq's blocks past those its tokens need: a step's rejected drafts had slots
        there. Such blocks hold no hash (hashes cover computed tokens only)."""
        keep = self.blocks_needed(seq.num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free_out_of_window(self, seq: Sequence):
        """With a sliding window on every layer: release seq's blocks that every query still to
        come (from position num_computed_tokens on) sees none of. Their hashes, published by then,
        stay cached."""
        if self.sliding_window is None:
            return
        first_visible = seq.num_computed_tokens - self.sliding_window + 1
        # Freed places are always a prefix of the table: walk back from the window's edge to the
        # last one, so a step costs the blocks it frees, not the whole context.
        i = max(0, first_visible) // self.block_size - 1
        while i >= 0 and seq.block_table[i] != FREED:
            self._release(seq.block_table[i])
            seq.block_table[i] = FREED
            i -= 1

    def _release(self, block_id: int):
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block_id] = None
            if block.hash is None:
                self.free_blocks.move_to_end(block_id, last=False)

    def check_invariants(self, seqs: list[Sequence]):
        """Assert the bookkeeping is consistent with the sequences that hold blocks (tests)."""
        refs = [0] * self.num_blocks
        for seq in seqs:
            for block_id in seq.block_table:
                if block_id != FREED:
                    refs[block_id] += 1
        used = sum(1 for r in refs if r > 0)
        assert used + self.num_free_blocks == self.num_blocks, "free + used != total"
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id} ref count is wrong"
            assert (block.block_id in self.free_blocks) == (block.ref_count == 0)
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h, "hash map points at a block with another hash"
        assert sum(b.hash is not None for b in self.blocks) == len(self.hash_to_block)
