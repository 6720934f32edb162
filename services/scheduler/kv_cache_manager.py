"""KVCacheManager: block tables per request over the BlockPool, prefix hits, fork,
copy-on-write and swapping against a CPU pool.

KV cache groups: the workers may lay the model's layers out in `len(group_windows)` groups
of equal size (a hybrid model: full-attention layers in some, sliding-window layers in
the others), each group with its own block table over the one pool. A request's table is
then stored flat, one entry per group for each block position: entry `pos * G + g` is group
g's block for tokens `pos * block_size ..`. One group of full attention is the plain case.

A group with a window (every layer of a Mistral-style model, or the local layers of a
Gemma 3) frees a block wholly before the window of the next query as the sequence grows;
its table entry becomes NULL_BLOCK: no kernel reads a position outside the window, so the
entry only keeps the table's positions. A freed block keeps its hash (other requests may
still hit it) until it is evicted, tail first. So a sequence holds at most `peak_blocks`
blocks, and one with windows everywhere fits however long it grows."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from services.common.block_hash import BlockHash
from services.scheduler.block_pool import BlockPool, KVCacheBlock
from services.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The table entry of a block freed outside the window (never read, never freed: block 0's
# id serves as any would).
NULL_BLOCK = KVCacheBlock(block_id=0, ref_cnt=1 << 62)


def _real(blocks: Sequence[KVCacheBlock]) -> list[KVCacheBlock]:
    return [block for block in blocks if block is not NULL_BLOCK]


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix cache's key of a block of `group`: group 0's is the chained hash itself
    (what KV events publish and routers compute), another group's tells its layers apart."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


class KVCacheManager:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        num_cpu_blocks: int = 0,
        enable_caching: bool = True,
        group_windows: Sequence[int] = (0,),
        max_step_tokens: int = 0,
    ) -> None:
        """`group_windows`: per KV cache group the window its layers attend within (0:
        full attention; nothing of that group is freed); `max_step_tokens`: the most tokens
        one step computes for a sequence (its chunk; 0: a whole prompt at once)."""
        windows = tuple(group_windows) or (0,)
        distinct = {w for w in windows if w}
        if len(distinct) > 1:
            raise ValueError(f"KV cache groups must share one window, got {windows}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.num_groups = len(windows)
        self.windowed = tuple(g for g, w in enumerate(windows) if w)
        self._groups = range(self.num_groups)
        self._full_groups = tuple(g for g, w in enumerate(windows) if not w)
        self.sliding_window = distinct.pop() if distinct else 0
        self.max_step_tokens = max_step_tokens
        self.num_nulled: dict[str, int] = {}  # request_id -> leading positions freed
        self.pool = BlockPool(num_blocks, enable_caching)
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}  # flat: G entries a position
        self.num_cached_blocks: dict[str, int] = {}  # positions
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
        """The request's table, flat: for each block position one id per group."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def num_held_blocks(self, request_id: str) -> int:
        """The blocks the request's table holds (freed entries outside the window not)."""
        return len(_real(self.req_to_blocks.get(request_id, [])))

    def peak_blocks(self, num_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` tokens holds at once: every group's
        for all of them, a windowed group's for the window and one step (chunked prefill)."""
        whole = cdiv(num_tokens, self.block_size)
        windowed = whole
        if self.sliding_window and self.max_step_tokens:
            span = self.sliding_window - 1 + self.max_step_tokens
            windowed = min(whole, cdiv(span, self.block_size) + 1)
        num_windowed = len(self.windowed)
        return (self.num_groups - num_windowed) * whole + num_windowed * windowed

    @property
    def holds_any_length(self) -> bool:
        """Whether a sequence of any length fits (every group has a window, and the peak
        under it fits)."""
        bounded = bool(self.sliding_window and self.max_step_tokens)
        every = len(self.windowed) == self.num_groups
        return bounded and every and self.peak_blocks(1 << 40) <= self.num_blocks

    def longest_sequence(self) -> int | None:
        """The most tokens one sequence can hold in the whole cache; None: any number."""
        if self.holds_any_length:
            return None
        low, high = 0, self.num_blocks  # block positions: each costs a full group >= 1
        while low < high:
            mid = (low + high + 1) // 2
            if self.peak_blocks(mid * self.block_size) <= self.num_blocks:
                low = mid
            else:
                high = mid - 1
        return low * self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full block positions (never the request's last
        token): every full-attention group's blocks of it, a windowed group's within the
        window of its first new token (NULL_BLOCK before it). Flat, G entries a position."""
        if not self.enable_caching or request.needs_every_prompt_position:
            return [], 0  # prompt logprobs (or a MEAN / CLS pooler) read every position
        max_hit = (request.num_tokens - 1) // self.block_size
        rows: list[list[KVCacheBlock | None]] = []
        for block_hash in request.block_hashes[:max_hit]:
            row = [self.pool.get_cached_block(group_key(block_hash, g)) for g in self._groups]
            if any(row[g] is None for g in self._full_groups):
                break
            rows.append(row)
        num_hit = len(rows)
        while num_hit and not self._window_cached(rows, num_hit):
            num_hit -= 1
        first = self._first_seen_position(num_hit * self.block_size)
        blocks = [
            NULL_BLOCK if g in self.windowed and pos < first else rows[pos][g]
            for pos in range(num_hit)
            for g in self._groups
        ]
        return blocks, num_hit * self.block_size  # type: ignore[return-value]

    def _first_seen_position(self, num_computed: int) -> int:
        """The first block position a query from num_computed on can see in a windowed
        group (0: no window)."""
        if not self.sliding_window:
            return 0
        return max(num_computed - self.sliding_window + 1, 0) // self.block_size

    def _window_cached(self, rows: list[list[KVCacheBlock | None]], num_hit: int) -> bool:
        first = self._first_seen_position(num_hit * self.block_size)
        return all(rows[pos][g] is not None for pos in range(first, num_hit) for g in self.windowed)

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
        which a draft model writes while it proposes), G a new position; None (and nothing
        changed but the blocks outside the window freed) if too few are free."""
        rid, groups = request.request_id, self.num_groups
        blocks = self.req_to_blocks.setdefault(rid, [])
        self._free_outside_window(rid, blocks, request.num_computed_tokens)
        num_hit = len(new_computed_blocks) // groups
        num_computed = request.num_computed_tokens + num_hit * self.block_size
        num_slots = num_computed + num_new_tokens + num_lookahead_tokens
        num_positions = len(blocks) // groups + num_hit
        num_new = max(cdiv(num_slots, self.block_size) - num_positions, 0) * groups
        cows = self._cow_indices(blocks, num_computed) if num_new_tokens else []
        num_evictable = sum(1 for b in _real(new_computed_blocks) if b.ref_cnt == 0)
        if num_new + len(cows) + num_evictable > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[rid]
            return None
        self.pool.touch(_real(new_computed_blocks))
        blocks.extend(new_computed_blocks)
        for index in cows:
            self._copy_on_write(rid, blocks, index)
        new_blocks = self.pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        self._free_outside_window(rid, blocks, num_computed)
        return new_blocks

    def _free_outside_window(self, rid: str, blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Free the windowed groups' blocks no query from position num_computed on can see
        (they lie wholly before num_computed - window + 1); tail first, so a prefix
        chain's head stays cached longest."""
        if not self.windowed:
            return
        start = self.num_nulled.get(rid, 0)
        end = min(self._first_seen_position(num_computed), len(blocks) // self.num_groups)
        if end <= start:
            return
        freed = []
        for pos in range(start, end):
            for g in self.windowed:
                index = pos * self.num_groups + g
                if blocks[index] is not NULL_BLOCK:  # a prefix hit's NULL entries
                    freed.append(blocks[index])
                blocks[index] = NULL_BLOCK
        self.pool.free_blocks(reversed(freed))
        self.num_nulled[rid] = end
        self._rewritten.add(rid)

    def _cow_indices(self, blocks: list[KVCacheBlock], write_pos: int) -> list[int]:
        """Entries of shared, partially filled blocks the next write would land in."""
        pos = write_pos // self.block_size
        if write_pos % self.block_size == 0 or pos >= len(blocks) // self.num_groups:
            return []
        entries = range(pos * self.num_groups, (pos + 1) * self.num_groups)
        return [i for i in entries if blocks[i] is not NULL_BLOCK and blocks[i].ref_cnt > 1]

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
        rid, groups = request.request_id, self.num_groups
        blocks = self.req_to_blocks[rid]
        start = self.num_cached_blocks.get(rid, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks) // groups)
        for pos in range(start, end):
            for g in self._groups:
                block = blocks[pos * groups + g]
                if block is not NULL_BLOCK:
                    self.pool.cache_full_block(block, group_key(request.block_hashes[pos], g))
        self.num_cached_blocks[rid] = max(start, end)

    def trim(self, request: Request) -> int:
        """Free the blocks past the request's computed tokens (those only rejected
        speculative tokens wrote); how many. The worker then gets the table whole."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, [])
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(blocks) <= keep * self.num_groups:
            return 0
        tail = blocks[keep * self.num_groups :]  # never behind the window: past the step's start
        del blocks[keep * self.num_groups :]
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
        num_positions = cdiv(parent.num_computed_tokens, self.block_size)
        blocks = blocks[: num_positions * self.num_groups]
        self.pool.touch(_real(blocks))
        self.req_to_blocks[child.request_id] = list(blocks)
        nulled = min(self.num_nulled.get(parent.request_id, 0), num_positions)
        if nulled:
            self.num_nulled[child.request_id] = nulled
        num_cached = self.num_cached_blocks.get(parent.request_id, 0)
        self.num_cached_blocks[child.request_id] = min(num_cached, num_positions)

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
        self.req_to_blocks.pop(rid, None)  # (a forked child may hold none yet)
        self.num_cached_blocks.pop(rid, None)
        self.swapped[rid] = cpu_ids  # None: an entry freed outside the window
        return mapping

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring the request back with room for num_new_tokens: (cpu, device) pairs, or None."""
        rid = request.request_id
        cpu_ids = self.swapped[rid]
        real_ids = [c for c in cpu_ids if c is not None]
        num_positions = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_required = num_positions * self.num_groups - (len(cpu_ids) - len(real_ids))
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
