"""ModelRegistry: which of many models are loaded, loading each on first use and unloading
it when idle, least recently used first when --models-max or memory runs out.

Everything runs on the event loop; a load (`loader(spec)`, which starts the engine-core
process in a thread) and an unload (`model.close()`) run as tasks, one at a time per model,
shielded from the requests that wait for them (a client that goes away cancels only its
own wait). Invariants: a model with users (requests holding it or waiting for it) is never
unloaded; pinned models are loaded at start and never unloaded; at most `models_max` models
hold a slot (loaded, unloading, or loading past admission).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from pagestream.models.keep_alive import FOREVER
from pagestream.models.memory_estimate import Footprint, footprint, gib, mem_available
from pagestream.models.model_entry import ModelEntry, ModelState
from pagestream.models.model_errors import ModelLoadFailedError, ModelMemoryError, ModelsBusyError
from pagestream.models.model_spec import ModelSpec
from pagestream.models.models_config import ModelsConfig
from services.frontend.openai.exceptions import ModelNotFoundError

logger = logging.getLogger(__name__)

SLOT_WAIT_S = 300.0  # how long a load waits for a busy model to go idle (--models-max)
REAP_INTERVAL_S = 0.5  # how often idle models are checked against their keep-alive


class Lease:
    """A request's hold on a loaded model; `release()` once its response has ended."""

    def __init__(self, registry: ModelRegistry, entry: ModelEntry, keep_alive: float | None):
        self._registry, self._entry, self._keep_alive = registry, entry, keep_alive
        self.model = entry.model
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._registry._release(self._entry, self._keep_alive)


class ModelRegistry:
    def __init__(
        self,
        specs: Iterable[ModelSpec],
        loader: Callable[[ModelSpec], Awaitable[object]],
        config: ModelsConfig,
        *,
        available: Callable[[], int | None] = mem_available,
        measure: Callable[[ModelSpec], Footprint] = lambda s: footprint(s.args, s.mmproj),
        slot_wait_s: float = SLOT_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.entries = {spec.name: ModelEntry(spec) for spec in specs}
        if not self.entries:
            raise ValueError("a model registry needs at least one model.")
        self.default_name = next(iter(self.entries))
        self._loader, self._measure, self._available = loader, measure, available
        self.config, self.slot_wait_s, self._clock = config, slot_wait_s, clock
        self._changed = asyncio.Event()  # set (and replaced) when a slot may have come free
        self._tasks: set[asyncio.Task] = set()
        self._reaper: asyncio.Task | None = None

    # ---- lookups --------------------------------------------------------------------
    def entry(self, name: str | None) -> ModelEntry:
        entry = self.entries.get(self.default_name if name is None else name)
        if entry is None:
            raise ModelNotFoundError(str(name)[:256])
        return entry

    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries.values() if e.state is ModelState.LOADED]

    # ---- requests -------------------------------------------------------------------
    async def acquire(self, name: str | None, keep_alive: float | None = None) -> Lease:
        """The model, loaded (waiting for its load if need be), held until the lease is
        released. Raises ModelNotFoundError, ModelLoadFailedError, ModelMemoryError or
        ModelsBusyError."""
        entry = self.entry(name)
        entry.users += 1
        try:
            await self._until_loaded(entry)
        except BaseException:
            self._release(entry, None)
            raise
        return Lease(self, entry, keep_alive)

    async def _until_loaded(self, entry: ModelEntry) -> None:
        while entry.state is not ModelState.LOADED:
            if entry.state is ModelState.FAILED:
                raise ModelLoadFailedError(entry.name, entry.error or "unknown error")
            if entry.task is None:  # unloaded: this request starts its load
                entry.state, entry.error = ModelState.LOADING, None
                entry.task = self._spawn(self._load(entry))
            await asyncio.shield(entry.task)

    def _release(self, entry: ModelEntry, keep_alive: float | None) -> None:
        entry.users -= 1
        entry.last_used = self._clock()
        if keep_alive is not None:
            entry.keep_alive = keep_alive
        if entry.users == 0:
            self._notify()
            if self._ttl(entry) == 0:
                self._spawn(self._unload(entry, "keep_alive 0"), quiet=True)

    def _ttl(self, entry: ModelEntry) -> float:
        if entry.keep_alive is not None:
            return entry.keep_alive
        idle = self.config.idle_unload_seconds
        return idle if idle > 0 else FOREVER

    # ---- explicit load / unload (POST /models/load, /models/unload) -----------------
    async def load(self, name: str) -> ModelEntry:
        """Load it now (a failed model is tried again); raises what its load raised."""
        entry = self.entry(name)
        if entry.state is ModelState.FAILED:
            entry.state = ModelState.UNLOADED
        lease = await self.acquire(name)
        lease.release()
        return entry

    async def unload(self, name: str) -> ModelEntry:
        """Unload it now, or, with requests in flight, as soon as they end."""
        entry = self.entry(name)
        if entry.spec.pinned:
            raise ValueError(f"model `{name}` is pinned: it stays loaded while the server runs.")
        if entry.task is not None and entry.state is ModelState.LOADING:
            await asyncio.shield(entry.task)
        if entry.users == 0:
            await self._unload(entry, "POST /models/unload")
        elif entry.state is ModelState.LOADED:
            entry.keep_alive = 0.0  # its last request's release unloads it
        return entry

    # ---- loading ----------------------------------------------------------------------
    async def _load(self, entry: ModelEntry) -> None:
        try:
            await self._admit(entry)
        except Exception as exc:  # no room: nothing started, the model stays unloaded
            entry.state, entry.error = ModelState.UNLOADED, str(exc)
            entry.task = None
            self._notify()
            raise
        logger.info("loading model %s (%s)", entry.name, entry.spec.args.model)
        try:
            entry.model = await self._loader(entry.spec)
        except Exception as exc:
            logger.error("model %s failed to load: %s", entry.name, exc)
            entry.state, entry.error = ModelState.FAILED, str(exc) or type(exc).__name__
            entry.holds_slot = False
        else:
            entry.state, entry.last_used = ModelState.LOADED, self._clock()
            logger.info("model %s loaded", entry.name)
        finally:
            entry.task = None
            self._notify()

    async def _admit(self, entry: ModelEntry) -> None:
        """Wait for a slot (--models-max) and memory, unloading idle models (least
        recently used first) to make them; then the entry holds its slot."""
        need = await asyncio.to_thread(self._measure, entry.spec)
        deadline = self._clock() + self.slot_wait_s
        budget, limit = self.config.memory_bytes(), self.config.models_max
        while True:
            holders = [e for e in self.entries.values() if e.holds_slot and e is not entry]
            if limit and len(holders) >= limit:
                if not await self._evict_one(entry, f"--models-max {limit}"):
                    busy = f"all {len(holders)} loaded models are busy (--models-max {limit})"
                    await self._wait_for_change(deadline, f"model `{entry.name}`: {busy}.")
                continue
            free = self._free_bytes(holders, budget)
            if free is not None and need.total > free:
                if await self._evict_one(entry, "memory"):
                    continue
                raise ModelMemoryError(
                    f"model `{entry.name}` needs {need.describe()}, but {gib(max(free, 0))} "
                    f"{'is left of --models-memory' if budget else 'is available'}"
                    " with every idle model unloaded."
                )
            entry.holds_slot, entry.footprint = True, need
            return

    def _free_bytes(self, holders: list[ModelEntry], budget: int | None) -> int | None:
        """Memory a new model may take: the budget less every holder's footprint, or
        MemAvailable less what the holders still loading have yet to take."""
        if budget is not None:
            return budget - sum(e.footprint.total for e in holders if e.footprint)
        available = self._available()
        if available is None:
            return None
        loading = [e for e in holders if e.state is ModelState.LOADING and e.footprint]
        return available - sum(e.footprint.total for e in loading)

    async def _evict_one(self, entry: ModelEntry, why: str) -> bool:
        idle = [e for e in self.entries.values() if e.evictable and e is not entry]
        if not idle:
            return False
        victim = min(idle, key=lambda e: e.last_used)
        await self._unload(victim, f"making room for {entry.name} ({why})")
        return True

    async def _wait_for_change(self, deadline: float, busy: str) -> None:
        remaining = deadline - self._clock()
        if remaining <= 0:
            raise ModelsBusyError(busy)
        try:
            await asyncio.wait_for(self._changed.wait(), remaining)
        except TimeoutError:
            raise ModelsBusyError(busy) from None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- unloading --------------------------------------------------------------------
    async def _unload(self, entry: ModelEntry, why: str) -> None:
        if entry.state is ModelState.UNLOADING and entry.task is not None:
            await asyncio.shield(entry.task)
            return
        if not (entry.state is ModelState.LOADED and entry.users == 0):
            return  # someone took it meanwhile, or it is gone already
        entry.state = ModelState.UNLOADING
        entry.task = self._spawn(self._close(entry, why))
        await asyncio.shield(entry.task)

    async def _close(self, entry: ModelEntry, why: str) -> None:
        model, entry.model = entry.model, None
        logger.info("unloading model %s (%s)", entry.name, why)
        try:
            await model.close()
        except Exception:
            logger.exception("model %s: unloading failed", entry.name)
        finally:
            entry.state, entry.holds_slot, entry.keep_alive = ModelState.UNLOADED, False, None
            entry.task = None
            self._notify()

    async def _reap(self) -> None:
        """Unload idle models whose keep-alive has passed."""
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            now = self._clock()
            for entry in self.entries.values():
                if entry.evictable and now - entry.last_used >= self._ttl(entry):
                    self._spawn(self._unload(entry, "idle"), quiet=True)

    # ---- life -------------------------------------------------------------------------
    def start(self) -> None:
        """The idle reaper, and the pinned models' loads (in the background)."""
        self._reaper = asyncio.ensure_future(self._reap())
        for entry in self.entries.values():
            if entry.spec.pinned:
                self._spawn(self.load(entry.name), quiet=True)

    async def close(self) -> None:
        """Stop the reaper, let loads under way end, unload every model."""
        if self._reaper is not None:
            self._reaper.cancel()
        pending = [e.task for e in self.entries.values() if e.task is not None]
        await asyncio.gather(*pending, return_exceptions=True)
        for entry in self.entries.values():
            entry.users = 0
        loaded = self.loaded()
        await asyncio.gather(*(self._unload(e, "shutdown") for e in loaded))

    def _spawn(self, coro, quiet: bool = False) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, quiet))
        return task

    def _done(self, task: asyncio.Task, quiet: bool) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()  # retrieved here, so asyncio never warns about it
        if exc is not None and quiet:
            logger.warning("model registry: %s", exc)
