"""Stop conditions on token ids, in vLLM's order."""

from __future__ import annotations

from services.scheduler.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The finished status the request's last token puts it in, or None to go on.

    Order: min_tokens (only length caps end a request before it), EOS unless ignore_eos,
    stop_token_ids (stop_reason = the id), max_tokens, max_model_len.
    """
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if last in params.all_stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
