"""Fixed-size KV blocks: a free list, reference counts and a prefix cache.

Prefix caching: a full block is keyed by a hash chained over the previous block's hash and its own
token ids, so equal keys mean equal prefixes. A freed block keeps its key (and its KV) until the
block is handed out again, so a later request with the same prefix can still find it. Free blocks
are handed out least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from sluice.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()  # kept to rule out hash collisions
    lora: str | None = None  # the adapter whose KV this is: the same tokens under another adapter differ
    images: tuple[str, ...] = ()  # content hashes of the images whose tokens it holds: same placeholders, other KV


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...], images: tuple[str, ...] = ()) -> int:
    return hash((prev_hash, token_ids, images)) if images else hash((prev_hash, token_ids))


def block_images(seq: Sequence, start: int, end: int) -> tuple[str, ...]:
    """Content hashes of ``seq``'s images with a token in positions [start, end)."""
    return tuple(x.key for x in seq.images if x.overlaps(start, end)) if seq.images else ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # Blocks leave the free list in id order until each has been used once, so the ids below this
        # mark are exactly the blocks ever handed out (the runner zeroes fresh cache memory lazily).
        self.num_touched = 0
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # ... and found there

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of ``seq``. At least one token is left to compute,
        since the last token's logits are needed and its block would otherwise be shared."""
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            return []  # a prompt to score is recomputed whole (engine/prompt_logprobs.py)
        hits: list[int] = []
        bs = self.block_size
        self._hash_blocks(seq, (seq.num_tokens - 1) // bs)
        for i, h in enumerate(seq.block_hashes[: (seq.num_tokens - 1) // bs]):
            block_id = self.hash_to_block.get(h)
            block = None if block_id is None else self.blocks[block_id]
            if (block_id is None or block is None or block.lora != seq.lora
                    or block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs])
                    or block.images != block_images(seq, i * bs, (i + 1) * bs)):
                break
            hits.append(block_id)
        return hits

    def can_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int, reserve: int = 0) -> bool:
        """Enough free blocks for ``seq``'s first chunk, counting cached hits that sit in the free list,
        with ``reserve`` blocks left over (for others that take theirs first)."""
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        return needed + revived + reserve <= self.num_free_blocks

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Give ``seq`` its cached prefix blocks; their tokens count as computed."""
        for block_id in hits:
            self._take(block_id)
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        if not seq.admitted:
            seq.admitted = True
            seq.num_cached_tokens = seq.num_computed_tokens
            self.query_tokens += seq.num_prompt_tokens
            self.hit_tokens += seq.num_computed_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make ``seq``'s block table cover ``num_new_tokens`` more tokens; False if the cache is full.

        Blocks that become full are published to the prefix cache right away: their tokens are known
        and their KV is written this step, before any layer reads it, so a request scheduled in the
        same step may share them.
        """
        total = seq.num_computed_tokens + num_new_tokens
        missing = self.blocks_for(total) - len(seq.block_table)
        if missing > self.num_free_blocks:
            return False
        for _ in range(missing):
            block_id = next(iter(self.free))
            self._take(block_id)
            self._forget(block_id)
            seq.block_table.append(block_id)
            self.num_touched = max(self.num_touched, block_id + 1)
        if self.enable_prefix_caching:
            self._publish_full_blocks(seq, total)
        return True

    def free_seq(self, seq: Sequence) -> None:
        # Tail blocks go back first, so they are reused before the (more shareable) head blocks.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _hash_blocks(self, seq: Sequence, num_full_blocks: int) -> None:
        """Extend ``seq.block_hashes`` to its first ``num_full_blocks`` blocks (token ids never change)."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_full_blocks):
            # A LoRA adapter's chain starts from its name: its KV is not the base's for the same tokens.
            prev = seq.block_hashes[-1] if seq.block_hashes else (None if seq.lora is None else hash(("lora", seq.lora)))
            images = block_images(seq, i * bs, (i + 1) * bs)
            seq.block_hashes.append(chain_hash(prev, tuple(seq.token_ids[i * bs : (i + 1) * bs]), images))

    def _publish_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        bs = self.block_size
        first = seq.num_computed_tokens // bs  # blocks before this were full, and seen, in earlier steps
        self._hash_blocks(seq, num_tokens // bs)
        for i in range(first, num_tokens // bs):
            block = self.blocks[seq.block_table[i]]
            h = seq.block_hashes[i]
            if block.hash is not None or h in self.hash_to_block:  # published, or another block has it
                continue
            block.hash, block.token_ids = h, tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block.lora, block.images = seq.lora, block_images(seq, i * bs, (i + 1) * bs)
            self.hash_to_block[h] = block.block_id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _forget(self, block_id: int) -> None:
        """A block handed out anew loses its old cached prefix."""
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids, block.lora, block.images = None, (), None, ()
