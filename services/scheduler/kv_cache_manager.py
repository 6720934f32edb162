"""KVCacheManager: block tables per request over the BlockPool, prefix hits, fork,
copy-on-write and swapping against a CPU pool.

With a `sliding_window` (a model whose every layer attends within one: Mistral-style), a
block wholly before the window of the next query is freed as the sequence grows and its
table entry becomes NULL_BLOCK: no kernel reads a position outside the window, so the
entry only keeps the table's positions. A freed block keeps its hash (other requests may
still hit it) until it is evicted, tail first. So a sequence holds at most
`peak_blocks` blocks however long it grows."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from services.scheduler.block_pool import BlockPool, KVCacheBlock
from services.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The table entry of a block freed outside the window (never read, never freed: block 0's
# id serves as any would).
NULL_BLOCK = KVCacheBlock(block_id=0, ref_cnt=1 << 62)


def _real(blocks: Sequence[KVCacheBlock]) -> list[KVCacheBlock]:
    return [block for block in blocks if block is not NULL_BLOCK]


class KVCacheManager:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        num_cpu_blocks: int = 0,
        enable_caching: bool = True,
        sliding_window: int = 0,
        max_step_tokens: int = 0,
    ) -> None:
        """`sliding_window`: the window every layer of the model attends within (0: some
        layer sees the whole context, nothing is freed); `max_step_tokens`: the most tokens
        one step computes for a sequence (its chunk; 0: a whole prompt at once)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.max_step_tokens = max_step_tokens
        self.num_nulled: dict[str, int] = {}  # request_id -> leading entries freed
        self.pool = BlockPool(num_blocks, enable_caching)
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.swapped: dict[str, list[int]] = {}  # request_id -> CPU block ids, in table order
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the plan
        self._rewritten: set[str] = set()  # tables changed in place (not just appended)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- queries -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def num_held_blocks(self, request_id: str) -> int:
        """The blocks the request's table holds (freed entries outside the window not)."""
        blocks = self.req_to_blocks.get(request_id, [])
        return len(blocks) - self.num_nulled.get(request_id, 0)

    def peak_blocks(self, num_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` tokens holds at once: all of them, or
        with a sliding window the window's and one step's (chunked prefill)."""
        whole = cdiv(num_tokens, self.block_size)
        if not self.sliding_window or not self.max_step_tokens:
            return whole
        return min(whole, cdiv(self.sliding_window - 1 + self.max_step_tokens, self.block_size) + 1)

    @property
    def holds_any_length(self) -> bool:
        """Whether a sequence of any length fits (its peak under the window does)."""
        return bool(self.sliding_window and self.max_step_tokens) and (
            self.peak_blocks(1 << 40) <= self.num_blocks
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks; never the request's last token."""
        if not self.enable_caching or request.needs_every_prompt_position:
            return [], 0  # prompt logprobs (or a MEAN / CLS pooler) read every position
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ---- allocation ----------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Blocks for num_new_tokens more tokens (and num_lookahead_tokens slots past them,
        which a draft model writes while it proposes); None (and nothing changed but the
        blocks outside the window freed) if too few are free."""
        rid = request.request_id
        blocks = self.req_to_blocks.setdefault(rid, [])
        self._free_outside_window(rid, blocks, request.num_computed_tokens)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_slots = num_computed + num_new_tokens + num_lookahead_tokens
        num_required = cdiv(num_slots, self.block_size)
        num_new = max(num_required - len(blocks) - len(new_computed_blocks), 0)
        cow_index = self._cow_index(blocks, num_computed) if num_new_tokens else None
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        needed = num_new + (cow_index is not None) + num_evictable
        if needed > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[rid]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if cow_index is not None:
            self._copy_on_write(rid, blocks, cow_index)
        new_blocks = self.pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        self._free_outside_window(rid, blocks, num_computed)
        return new_blocks

    def _free_outside_window(self, rid: str, blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Free the blocks no query from position num_computed on can see (they lie wholly
        before num_computed - window + 1); tail first, so a prefix chain's head stays
        cached longest."""
        if not self.sliding_window:
            return
        first_seen = num_computed - self.sliding_window + 1
        start = self.num_nulled.get(rid, 0)
        end = min(max(first_seen, 0) // self.block_size, len(blocks))
        if end <= start:
            return
        freed = blocks[start:end]
        blocks[start:end] = [NULL_BLOCK] * (end - start)
        self.pool.free_blocks(reversed(freed))
        self.num_nulled[rid] = end
        self._rewritten.add(rid)

    def _cow_index(self, blocks: list[KVCacheBlock], write_pos: int) -> int | None:
        """Index of a shared, partially filled block the next write would land in."""
        index = write_pos // self.block_size
        if write_pos % self.block_size == 0 or index >= len(blocks):
            return None
        return index if blocks[index].ref_cnt > 1 else None

    def _copy_on_write(self, rid: str, blocks: list[KVCacheBlock], index: int) -> None:
        (private,) = self.pool.get_new_blocks(1)
        shared = blocks[index]
        self.pending_copies.append((shared.block_id, private.block_id))
        self.pool.free_blocks([shared])
        blocks[index] = private
        self._rewritten.add(rid)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_to_blocks[rid]
        start = self.num_cached_blocks.get(rid, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for i in range(start, end):
            if blocks[i] is not NULL_BLOCK:
                self.pool.cache_full_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[rid] = max(start, end)

    def trim(self, request: Request) -> int:
        """Free the blocks past the request's computed tokens (those only rejected
        speculative tokens wrote); how many. The worker then gets the table whole."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, [])
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(blocks) <= keep:
            return 0
        tail = blocks[keep:]  # never behind the window: that lies before the step's start
        del blocks[keep:]
        self.pool.free_blocks(reversed(tail))
        self.num_cached_blocks[rid] = min(self.num_cached_blocks.get(rid, 0), keep)
        self._rewritten.add(rid)
        return len(tail)

    def take_rewritten(self, rid: str) -> bool:
        """Whether the request's table changed in place (copy-on-write) since the worker
        last got it whole; the worker gets it whole now, so it is forgotten."""
        if rid not in self._rewritten:
            return False
        self._rewritten.discard(rid)
        return True

    def uncache(self, request: Request) -> None:
        """Forget the hashes of the request's blocks no other request holds (their
        contents are not to be trusted), before it frees them."""
        for block in _real(self.req_to_blocks.get(request.request_id, [])):
            if block.ref_cnt == 1:
                self.pool.uncache(block)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so a chain's tail is evicted before its head."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        self.pool.free_blocks(reversed(_real(blocks)))
        self.num_cached_blocks.pop(rid, None)
        self.num_nulled.pop(rid, None)
        self._rewritten.discard(rid)
        self.cpu_free.extend(c for c in self.swapped.pop(rid, []) if c is not None)

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares the parent's blocks that hold its computed tokens (ref counts
        bumped). Not the blocks past them (a draft model's lookahead slots): each sequence
        writes its own tokens there, and copy-on-write only guards the block of the next
        write, so the child allocates its own."""
        blocks = self.req_to_blocks.get(parent.request_id, [])
        blocks = blocks[: cdiv(parent.num_computed_tokens, self.block_size)]
        self.pool.touch(_real(blocks))
        self.req_to_blocks[child.request_id] = list(blocks)
        nulled = min(self.num_nulled.get(parent.request_id, 0), len(blocks))
        if nulled:
            self.num_nulled[child.request_id] = nulled
        num_cached = self.num_cached_blocks.get(parent.request_id, 0)
        self.num_cached_blocks[child.request_id] = min(num_cached, len(blocks))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- swapping ------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's KV to the CPU pool: (device, cpu) pairs, or None if it won't fit."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, [])
        real = _real(blocks)
        if len(real) > len(self.cpu_free):
            return None
        cpu_ids = [None if b is NULL_BLOCK else self.cpu_free.popleft() for b in blocks]
        mapping = [(b.block_id, c) for b, c in zip(blocks, cpu_ids, strict=True) if c is not None]
        self.pool.free_blocks(reversed(real))
        del self.req_to_blocks[rid]
        self.num_cached_blocks.pop(rid, None)
        self.swapped[rid] = cpu_ids  # None: an entry freed outside the window
        return mapping

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring the request back with room for num_new_tokens: (cpu, device) pairs, or None."""
        rid = request.request_id
        cpu_ids = self.swapped[rid]
        real_ids = [c for c in cpu_ids if c is not None]
        num_required = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_required -= len(cpu_ids) - len(real_ids)  # the entries outside the window
        if max(num_required, len(real_ids)) > self.pool.num_free_blocks:
            return None
        new = iter(self.pool.get_new_blocks(len(real_ids)))
        blocks = [NULL_BLOCK if c is None else next(new) for c in cpu_ids]
        self.req_to_blocks[rid] = blocks
        del self.swapped[rid]
        self.cpu_free.extend(real_ids)
        pairs = zip(cpu_ids, blocks, strict=True)
        mapping = [(c, b.block_id) for c, b in pairs if c is not None]
        self.allocate_slots(request, num_new_tokens)
        return mapping

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
