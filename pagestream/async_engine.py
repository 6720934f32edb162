"""AsyncEngine: the engine behind an asyncio API.

A Frontend over an engine core that by default runs in a process of its own
(engine_core_process.py), reached over gRPC on a unix socket, so detokenization and this
process's servers never share an interpreter lock with the step; `engine_core_process=False`
keeps it here (inproc_client.py), for debugging and for code that looks inside the engine.
A dead engine raises EngineUnavailableError; a lost engine-core process is restarted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pagestream.engine_args import EngineArgs
from pagestream.engine_core_process import EngineCoreProcess
from pagestream.engine_core_spare import SparePool
from pagestream.inproc_client import InprocEngineCoreClient
from pagestream.tensor_outputs import as_tensors
from services.common.engine_errors import EngineUnavailableError
from services.common.outputs import PoolingRequestOutput, RequestOutput
from services.common.pooling_params import PoolingParams
from services.common.request_options import RequestOptions
from services.common.sampling_params import SamplingParams
from services.frontend.frontend import Frontend
from services.frontend.frontend_config import FrontendConfig
from services.frontend.model_files import ModelFiles
from services.scheduler.async_engine_core import AsyncEngineCore, EngineDeadError

# EngineDeadError stays importable from here; the Frontend raises EngineUnavailableError.
__all__ = ["AsyncEngine", "EngineDeadError", "EngineUnavailableError"]


class AsyncEngine:
    def __init__(
        self,
        args: EngineArgs,
        engine_core_process: bool = True,
        frontend_config: FrontendConfig | None = None,
        spares: SparePool | None = None,
    ) -> None:
        """`spares`: the engine-core process starts in an interpreter whose imports are done
        (pagestream/engine_core_spare.py), when one is ready."""
        self.args = args
        self.frontend_config = frontend_config
        self.engine = None  # the LLMEngine: in-process layout only
        self.engine_core: AsyncEngineCore | None = None  # in-process layout only
        self.process: EngineCoreProcess | None = None  # the engine-core process layout
        self._frontend: Frontend | None = None
        if engine_core_process:
            self._start_process(args, spares)
        else:
            from pagestream.llm_engine import LLMEngine  # torch: only where the step runs

            self.engine = LLMEngine(args)
            self.engine_core = AsyncEngineCore(self.engine.core)
            self.info = self.engine.info
            self.tokenizer = self.engine.tokenizer
            self.default_sampling = self.engine.default_sampling
            self.images = self.engine.images

    def _start_process(self, args: EngineArgs, spares: SparePool | None) -> None:
        # Read first: a GGUF file is converted once, here, before the engine core starts.
        files = ModelFiles.load(args.model, args.generation_config)
        self.tokenizer, self.default_sampling = files.tokenizer, files.default_sampling
        self.images = files.images
        self.process = EngineCoreProcess(args, spares=spares)
        self.info = self.process.start()

    @classmethod
    def from_args(
        cls, model: str | None = None, engine_core_process: bool = True, **engine_args
    ) -> AsyncEngine:
        if model is not None:
            engine_args["model"] = model
        return cls(EngineArgs.from_kwargs(**engine_args), engine_core_process)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, engine_core_process: bool = True) -> AsyncEngine:
        return cls(args, engine_core_process)

    @property
    def frontend(self) -> Frontend:
        """Created on first use, inside the running event loop."""
        if self._frontend is None:
            if self.process is not None:
                from services.frontend.grpc_engine_client import GrpcEngineCoreClient

                client = GrpcEngineCoreClient.open(self.process.address)
            else:
                client = InprocEngineCoreClient(self.engine_core)
            self._frontend = Frontend(
                client,
                self.tokenizer,
                self.info,
                self.default_sampling,
                self.frontend_config,
                self.images,
            )
        return self._frontend

    def generate(
        self,
        prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **kwargs,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs (cumulative or delta, per output_kind) until the request ends.

        kwargs: priority, cache_salt, add_special_tokens, lora_request (RequestOptions'
        fields). A consumer that stops iterating aborts the request.
        """
        options = RequestOptions(**kwargs)
        return self.frontend.generate(prompt, sampling_params, request_id, options)

    async def encode(
        self,
        prompt,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        **kwargs,
    ) -> PoolingRequestOutput:
        """One prompt's pooled output on a pooling engine (runner="pooling"): its
        embedding for task "embed" (the default), the raw pooled state for "encode".
        kwargs: priority, cache_salt, add_special_tokens."""
        options = RequestOptions(**kwargs)
        output = await self.frontend.encode(prompt, pooling_params, request_id, options)
        return as_tensors(output)

    async def abort(self, request_id: str) -> None:
        """End a request; its stream gets a final output with finish_reason "abort"."""
        await self.frontend.abort(request_id)

    async def shutdown(self) -> None:
        if self._frontend is not None:
            await self._frontend.close()
        if self.process is not None:
            await asyncio.to_thread(self.process.close)
            return
        await self.engine_core.shutdown()
        await asyncio.to_thread(self.engine.close)  # the workers (mp: their processes)
