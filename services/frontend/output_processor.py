"""OutputProcessor: turns engine-core outputs into RequestOutputs for every live request."""

from __future__ import annotations

from services.common.engine_output import EngineCoreOutput
from services.common.outputs import RequestOutput
from services.frontend.request_state import RequestState


class OutputProcessor:
    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}

    def add(self, state: RequestState) -> None:
        if state.request_id in self.states:
            raise ValueError(f"request_id {state.request_id!r} is already in use.")
        self.states[state.request_id] = state

    def remove(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)

    def process(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[tuple[RequestState, RequestOutput]], list[str]]:
        """Apply a step's outputs; returns (state, output) pairs to deliver and ids to abort."""
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            state = self.states.get(out.parent_request_id or out.request_id)
            if state is None:
                continue  # already gone (aborted by its client)
            abort_id = state.process(out)
            if abort_id is not None:
                to_abort.append(abort_id)
            touched[state.request_id] = state
        ready = []
        for request_id, state in touched.items():
            output = state.make_output()
            if output is not None:
                ready.append((state, output))
            if state.finished:
                self.states.pop(request_id, None)
        return ready, to_abort
