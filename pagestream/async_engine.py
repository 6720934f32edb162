"""AsyncEngine: the whole engine in one process behind an asyncio API.

A Frontend (tokenize, detokenize, stream) over the in-process EngineCoreClient
(pagestream/inproc_client.py), over the AsyncEngineCore step loop, over the Worker. The
same Frontend runs over gRPC in the split deployment; here the calls are direct. When the
engine dies, calls raise EngineUnavailableError (whichever transport carries them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pagestream.engine_args import EngineArgs
from pagestream.inproc_client import InprocEngineCoreClient
from pagestream.llm_engine import LLMEngine
from services.common.outputs import RequestOutput
from services.common.sampling_params import SamplingParams
from services.frontend.engine_client import EngineUnavailableError
from services.frontend.frontend import Frontend
from services.scheduler.async_engine_core import AsyncEngineCore, EngineDeadError

# EngineDeadError stays importable from here; the Frontend raises EngineUnavailableError.
__all__ = ["AsyncEngine", "EngineDeadError", "EngineUnavailableError"]


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.engine_core = AsyncEngineCore(engine.core)
        self.info = engine.served_model_info()
        self._frontend: Frontend | None = None

    @classmethod
    def from_args(cls, model: str | None = None, **engine_args) -> AsyncEngine:
        if model is not None:
            engine_args["model"] = model
        return cls(LLMEngine(EngineArgs.from_kwargs(**engine_args)))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncEngine:
        return cls(LLMEngine(args))

    @property
    def frontend(self) -> Frontend:
        """Created on first use, inside the running event loop."""
        if self._frontend is None:
            client = InprocEngineCoreClient(self.engine_core)
            self._frontend = Frontend(
                client, self.engine.tokenizer, self.info, self.engine.default_sampling
            )
        return self._frontend

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **kwargs,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs (cumulative or delta, per output_kind) until the request ends.

        kwargs: priority, cache_salt, add_special_tokens. A consumer that stops iterating
        aborts the request.
        """
        return self.frontend.generate(prompt, sampling_params, request_id, **kwargs)

    async def abort(self, request_id: str) -> None:
        """End a request; its stream gets a final output with finish_reason "abort"."""
        await self.frontend.abort(request_id)

    async def shutdown(self) -> None:
        if self._frontend is not None:
            await self._frontend.close()
        await self.engine_core.shutdown()
        await asyncio.to_thread(self.engine.close)  # the workers (mp: their processes)
