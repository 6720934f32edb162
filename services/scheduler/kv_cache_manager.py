"""KVCacheManager: block tables per request over the BlockPool, prefix hits, fork,
copy-on-write and swapping against a CPU pool.

A request's table holds one list per KV cache group (layers sharing one block table; a
hybrid model has full-attention and sliding-window groups), all of one length: entry
`pos` of group g's list is its block for tokens `pos * block_size ..`. A windowed group's
block wholly before the next query's window is freed and its entry becomes NULL_BLOCK, so a
sequence holds at most `peak_blocks` blocks. A freed block keeps its hash until evicted.

With KV offload tiers (`offload`, one full-attention group only) a block registered in the
prefix cache is saved to them (write-through), and a prefix lookup continues past the
device's hits into the tiers: those blocks get fresh device blocks the worker reads the
tier's contents into before the step's forward (KvOffloadTransfers)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import TypeVar

from services.common.block_hash import BlockHash
from services.common.scheduler_output import BlockTable
from services.scheduler.block_pool import BlockPool, KVCacheBlock
from services.scheduler.encoder_budget import ends_inside_image
from services.scheduler.kv_offload_index import KvOffloadIndex
from services.scheduler.kv_offload_transfers import KvOffloadTransfers
from services.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The table entry of a block freed outside the window (never read, never freed: block 0's
# id serves as any would).
NULL_BLOCK = KVCacheBlock(block_id=0, ref_cnt=1 << 62)


# A request's table: per KV cache group its blocks, one per block position.
Tables = list[list[KVCacheBlock]]
T = TypeVar("T")


def _real(blocks: Iterable[KVCacheBlock]) -> list[KVCacheBlock]:
    return [block for block in blocks if block is not NULL_BLOCK]


def _position_major(tables: Sequence[Sequence[T]]) -> list[T]:
    """Every entry, position by position and each position's groups in order: the order
    blocks are taken from and given back to the pool (tail first when reversed)."""
    return [block for row in zip(*tables, strict=True) for block in row]


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
        self.req_to_blocks: dict[str, Tables] = {}
        self.num_cached_blocks: dict[str, int] = {}  # positions
        # request_id -> per group the CPU block ids of its table (None: freed outside the window)
        self.swapped: dict[str, list[list[int | None]]] = {}
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the plan
        self._rewritten: set[str] = set()  # tables changed in place (not just appended)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.offload: KvOffloadIndex | None = None  # the KV offload tiers (use_offload)
        self.transfers: KvOffloadTransfers | None = None  # what moves to and from them

    def use_offload(self, offload: KvOffloadIndex | None) -> None:
        """Save to and load from the KV offload tiers `offload` indexes (None: none)."""
        if offload is not None and not (self.enable_caching and self.num_groups == 1):
            raise ValueError("KV offload tiers need prefix caching and one KV cache group")
        if offload is not None and self.windowed:
            raise ValueError("KV offload tiers need a full-attention KV cache group")
        self.offload = offload if offload is not None and offload.enabled else None
        self.transfers = None
        if self.offload is not None:
            self.offload.events = self.pool.events  # routers listening already
            self.transfers = KvOffloadTransfers(self.offload, self.pool)

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

    def block_table(self, request_id: str) -> BlockTable:
        """The request's block ids, per group (empty lists for a request holding none)."""
        tables = self.req_to_blocks.get(request_id) or self._empty()
        return tuple([b.block_id for b in blocks] for blocks in tables)

    def num_held_blocks(self, request_id: str) -> int:
        """The blocks the request's table holds (freed entries outside the window not)."""
        return sum(len(_real(blocks)) for blocks in self.req_to_blocks.get(request_id, []))

    def _empty(self) -> Tables:
        return [[] for _ in self._groups]

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

    def get_computed_blocks(self, request: Request) -> tuple[Tables, int]:
        """The longest cached prefix of full block positions (never the request's last
        token), per group: every full-attention group's blocks of it, a windowed group's
        within the window of its first new token (NULL_BLOCK before it)."""
        if not self.enable_caching or request.needs_every_prompt_position:
            return self._empty(), 0  # prompt logprobs (or a MEAN / CLS pooler) read every position
        max_hit = (request.num_tokens - 1) // self.block_size
        rows: list[list[KVCacheBlock | None]] = []
        for block_hash in request.block_hashes[:max_hit]:
            row = [self.pool.get_cached_block(group_key(block_hash, g)) for g in self._groups]
            if any(row[g] is None for g in self._full_groups):
                break
            rows.append(row)
        num_device = len(rows)
        num_hit = num_device
        if self.transfers is not None:
            num_hit += self.transfers.num_held(request.block_hashes[num_device:max_hit])
        while num_hit and not self._hit_usable(request, rows, num_hit):
            num_hit -= 1
        first = self._first_seen_position(num_hit * self.block_size)
        tables = [
            [
                NULL_BLOCK if g in self.windowed and pos < first else rows[pos][g]
                for pos in range(min(num_hit, num_device))
            ]
            for g in self._groups
        ]
        # Past the device's blocks: the tiers' (allocate_slots' num_loaded).
        return tables, num_hit * self.block_size  # type: ignore[return-value]

    def _first_seen_position(self, num_computed: int) -> int:
        """The first block position a query from num_computed on can see in a windowed
        group (0: no window)."""
        if not self.sliding_window:
            return 0
        return max(num_computed - self.sliding_window + 1, 0) // self.block_size

    def _hit_usable(
        self, request: Request, rows: list[list[KVCacheBlock | None]], num_hit: int
    ) -> bool:
        """A hit of num_hit blocks holds its window's blocks and does not end inside an
        image's span (an image is computed in one step: encoder_budget.py)."""
        end = num_hit * self.block_size
        return self._window_cached(rows, num_hit) and not ends_inside_image(request.images, end)

    def _window_cached(self, rows: list[list[KVCacheBlock | None]], num_hit: int) -> bool:
        # (a hit past the rows is the tiers': they hold only models without windows)
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
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]] = (),
        num_lookahead_tokens: int = 0,
        num_loaded: int = 0,
    ) -> Tables | None:
        """Blocks for num_new_tokens more tokens (and num_lookahead_tokens slots past them,
        which a draft model writes while it proposes), per group the new positions' blocks;
        None (and nothing changed but the blocks outside the window freed) if too few are
        free. `new_computed_blocks`: a prefix hit (get_computed_blocks), per group;
        `num_loaded`: the hit's blocks past them that the offload tiers hold (the first
        new blocks, read back before the step's forward)."""
        rid = request.request_id
        tables = self.req_to_blocks.setdefault(rid, self._empty())
        self._free_outside_window(rid, tables, request.num_computed_tokens)
        hit = _position_major(new_computed_blocks) if new_computed_blocks else []
        num_hit = len(new_computed_blocks[0]) if new_computed_blocks else 0
        num_computed = request.num_computed_tokens + (num_hit + num_loaded) * self.block_size
        num_slots = num_computed + num_new_tokens + num_lookahead_tokens
        num_positions = len(tables[0]) + num_hit
        num_new = max(cdiv(num_slots, self.block_size) - num_positions, 0)
        cows = self._cow_groups(tables, num_computed) if num_new_tokens else []
        num_evictable = sum(1 for b in _real(hit) if b.ref_cnt == 0)
        if num_new * self.num_groups + len(cows) + num_evictable > self.pool.num_free_blocks:
            if not tables[0]:
                del self.req_to_blocks[rid]
            return None
        self.pool.touch(_real(hit))
        if self.transfers is not None:
            self.transfers.read(request, hit)
        for blocks, hit_blocks in zip(tables, new_computed_blocks or self._empty(), strict=True):
            blocks.extend(hit_blocks)
        pos = num_computed // self.block_size
        for group in cows:
            self._copy_on_write(rid, tables, group, pos)
        new_blocks = self._take_positions(num_new)
        if num_loaded:
            assert self.transfers is not None, "a hit in the tiers without tiers"
            loaded = new_blocks[0][:num_loaded]
            self.transfers.load(request, len(tables[0]), loaded, self.block_size)
        for blocks, added in zip(tables, new_blocks, strict=True):
            blocks.extend(added)
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        self._free_outside_window(rid, tables, num_computed)
        return new_blocks

    def _take_positions(self, num_positions: int) -> Tables:
        """Fresh blocks for num_positions positions, per group (taken position-major)."""
        taken = iter(self.pool.get_new_blocks(num_positions * self.num_groups))
        rows = [[next(taken) for _ in self._groups] for _ in range(num_positions)]
        return [list(column) for column in zip(*rows, strict=True)] if rows else self._empty()

    def _free_outside_window(self, rid: str, tables: Tables, num_computed: int) -> None:
        """Free the windowed groups' blocks no query from position num_computed on can see
        (they lie wholly before num_computed - window + 1); tail first, so a prefix
        chain's head stays cached longest."""
        if not self.windowed:
            return
        start = self.num_nulled.get(rid, 0)
        end = min(self._first_seen_position(num_computed), len(tables[0]))
        if end <= start:
            return
        freed = []
        for pos in range(start, end):
            for g in self.windowed:
                if tables[g][pos] is not NULL_BLOCK:  # a prefix hit's NULL entries
                    freed.append(tables[g][pos])
                tables[g][pos] = NULL_BLOCK
        self.pool.free_blocks(reversed(freed))
        self.num_nulled[rid] = end
        self._rewritten.add(rid)

    def _cow_groups(self, tables: Tables, write_pos: int) -> list[int]:
        """The groups whose block at the next write's position is shared and partially
        filled (the write would land in it)."""
        pos = write_pos // self.block_size
        if write_pos % self.block_size == 0 or pos >= len(tables[0]):
            return []
        return [
            g
            for g in self._groups
            if tables[g][pos] is not NULL_BLOCK and tables[g][pos].ref_cnt > 1
        ]

    def _copy_on_write(self, rid: str, tables: Tables, group: int, pos: int) -> None:
        (private,) = self.pool.get_new_blocks(1)
        shared = tables[group][pos]
        self.pending_copies.append((shared.block_id, private.block_id))
        self.pool.free_blocks([shared])
        tables[group][pos] = private
        self._rewritten.add(rid)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        tables = self.req_to_blocks[rid]
        start = self.num_cached_blocks.get(rid, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes), len(tables[0]))
        for pos in range(start, end):
            for g in self._groups:
                block = tables[g][pos]
                if block is not NULL_BLOCK:
                    self._cache_full_block(block, group_key(request.block_hashes[pos], g))
        self.num_cached_blocks[rid] = max(start, end)

    def _cache_full_block(self, block: KVCacheBlock, key: BlockHash) -> None:
        """Register the block; one newly registered under a key no tier holds is saved
        (the worker copies it out after this step's forward fills it)."""
        fresh = block.block_hash is None
        self.pool.cache_full_block(block, key)
        if self.transfers is not None and fresh and self.pool.get_cached_block(key) is block:
            self.transfers.registered(block, key)

    def trim(self, request: Request) -> int:
        """Free the blocks past the request's computed tokens (those only rejected
        speculative tokens wrote); how many. The worker then gets the table whole."""
        rid = request.request_id
        tables = self.req_to_blocks.get(rid) or self._empty()
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(tables[0]) <= keep:
            return 0
        # never behind the window: past the step's start
        tail = _position_major([blocks[keep:] for blocks in tables])
        for blocks in tables:
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
        contents are not to be trusted), before it frees them; the tiers forget them too."""
        for block in _real(_position_major(self.req_to_blocks.get(request.request_id, []))):
            if block.ref_cnt == 1:
                self._forget(block)

    def discard_from(self, request: Request, first: int) -> None:
        """The request's blocks from position `first` on hold garbage (computed after a
        failed load): they leave the prefix cache and the tiers, whoever holds them (every
        holder holds the failed block too, being a prefix hit through it)."""
        tables = self.req_to_blocks.get(request.request_id, [])
        for block in _real(_position_major([blocks[first:] for blocks in tables])):
            self._forget(block)
        self.num_cached_blocks[request.request_id] = min(
            self.num_cached_blocks.get(request.request_id, 0), first
        )

    def _forget(self, block: KVCacheBlock) -> None:
        if self.offload is not None and block.block_hash is not None:
            self.offload.forget(block.block_hash)
        self.pool.uncache(block)

    def land_loads(
        self, loads: Sequence[tuple[BlockHash, int]], failures: Iterable[BlockHash]
    ) -> set[int]:
        """A plan's loads landed (KvOffloadTransfers.land): the failed loads' block ids,
        every live request holding one to be recomputed."""
        return self.transfers.land(loads, failures) if self.transfers is not None else set()

    def first_position_of(self, request: Request, block_ids: set[int]) -> int | None:
        """The first block position of the request's table holding one of `block_ids`."""
        tables = self.req_to_blocks.get(request.request_id) or self._empty()
        for pos, block in enumerate(tables[0]):
            if block.block_id in block_ids and block is not NULL_BLOCK:
                return pos
        return None

    def take_offload_drops(self) -> list[tuple[BlockHash, str]]:
        """The tiers' drops decided before this step (a plan applies them before its loads
        and saves, so the drops decided while planning it wait for the next plan)."""
        return self.offload.take_drops() if self.offload is not None else []

    def take_offload_transfers(self) -> tuple[list, list]:
        """This step's (kv_loads, kv_saves), forgotten here."""
        return self.transfers.take() if self.transfers is not None else ([], [])

    @property
    def offload_hits(self) -> int:
        return self.transfers.hits if self.transfers is not None else 0

    @property
    def offload_failures(self) -> int:
        return self.transfers.failures if self.transfers is not None else 0

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so a chain's tail is evicted before its head."""
        rid = request.request_id
        tables = self.req_to_blocks.pop(rid, [])
        self.pool.free_blocks(reversed(_real(_position_major(tables))))
        self.num_cached_blocks.pop(rid, None)
        self.num_nulled.pop(rid, None)
        self._rewritten.discard(rid)
        cpu_ids = _position_major(self.swapped.pop(rid, []))
        self.cpu_free.extend(c for c in cpu_ids if c is not None)

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares the parent's blocks that hold its computed tokens (ref counts
        bumped). Not the blocks past them (a draft model's lookahead slots): each sequence
        writes its own tokens there, and copy-on-write only guards the block of the next
        write, so the child allocates its own."""
        tables = self.req_to_blocks.get(parent.request_id) or self._empty()
        num_positions = cdiv(parent.num_computed_tokens, self.block_size)
        shared = [blocks[:num_positions] for blocks in tables]
        self.pool.touch(_real(_position_major(shared)))
        self.req_to_blocks[child.request_id] = shared
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
        tables = self.req_to_blocks.get(rid) or self._empty()
        real = _real(_position_major(tables))
        if len(real) > len(self.cpu_free):
            return None
        cpu_ids: list[list[int | None]] = [[] for _ in self._groups]
        mapping = []
        for row in zip(*tables, strict=True):  # CPU ids taken position-major
            for cpu_table, block in zip(cpu_ids, row, strict=True):
                cpu = None if block is NULL_BLOCK else self.cpu_free.popleft()
                cpu_table.append(cpu)
                if cpu is not None:
                    mapping.append((block.block_id, cpu))
        self.pool.free_blocks(reversed(real))
        self.req_to_blocks.pop(rid, None)  # (a forked child may hold none yet)
        self.num_cached_blocks.pop(rid, None)
        self.swapped[rid] = cpu_ids
        return mapping

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring the request back with room for num_new_tokens: (cpu, device) pairs, or None."""
        rid = request.request_id
        cpu_tables = self.swapped[rid]
        cpu_ids = _position_major(cpu_tables)
        real_ids = [c for c in cpu_ids if c is not None]
        num_positions = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_required = num_positions * self.num_groups - (len(cpu_ids) - len(real_ids))
        if max(num_required, len(real_ids)) > self.pool.num_free_blocks:
            return None
        new = iter(self.pool.get_new_blocks(len(real_ids)))
        mapping = []
        tables = self._empty()
        for row in zip(*cpu_tables, strict=True):  # device blocks taken position-major
            for blocks, cpu in zip(tables, row, strict=True):
                block = NULL_BLOCK if cpu is None else next(new)
                blocks.append(block)
                if cpu is not None:
                    mapping.append((cpu, block.block_id))
        self.req_to_blocks[rid] = tables
        del self.swapped[rid]
        self.cpu_free.extend(real_ids)
        self.allocate_slots(request, num_new_tokens)
        return mapping

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
