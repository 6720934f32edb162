"""LoadedModel: one model of a multi-model serve while it is loaded: its AsyncEngine (the
engine-core process), the FastAPI app over its Frontend, and that app's metrics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pagestream.async_engine import AsyncEngine
from pagestream.engine_core_spare import SparePool
from pagestream.models.model_spec import ModelSpec
from services.frontend.frontend_config import FrontendConfig
from services.frontend.lora_options import LoRAServerOptions
from services.frontend.metrics import FrontendMetrics
from services.frontend.openai.app import build_app
from services.frontend.tool_options import ToolServerOptions


@dataclass
class LoadedModel:
    engine: AsyncEngine
    app: object  # the per-model FastAPI app (build_app), served under the dispatcher
    metrics: FrontendMetrics

    @property
    def frontend(self):
        return self.engine.frontend

    @property
    def pid(self) -> int | None:
        return self.engine.process.pid if self.engine.process is not None else None

    async def close(self) -> None:
        """The engine-core process exits; its weights and KV cache go with it."""
        await self.engine.shutdown()


@dataclass(frozen=True)
class ModelLoader:
    """How serve loads a model: its engine core in a process of its own (started in a
    thread, off the event loop), behind build_app with serve's HTTP options."""

    frontend_config: FrontendConfig | None = None
    api_key: str | None = None
    tools: ToolServerOptions | None = None
    lora: LoRAServerOptions | None = None
    # Engine-core interpreters started ahead (engine_core_spare.py): a load skips the
    # seconds of imports; the next spare starts once the load is over (not beside it).
    spares: SparePool | None = None

    async def __call__(self, spec: ModelSpec) -> LoadedModel:
        try:
            engine = await asyncio.to_thread(self._start, spec)
        finally:
            if self.spares is not None:
                self.spares.refill()
        try:
            metrics = FrontendMetrics()
            app = build_app(
                engine.frontend,
                [spec.name],
                api_key=self.api_key,
                metrics=metrics,
                tool_options=self.tools,
                lora=self.lora,
            )
        except BaseException:
            await engine.shutdown()
            raise
        return LoadedModel(engine, app, metrics)

    def _start(self, spec: ModelSpec) -> AsyncEngine:
        # spec.engine_args() converts a GGUF + mmproj pair on its first load: here, in the thread
        return AsyncEngine(spec.engine_args(), True, self.frontend_config, self.spares)
