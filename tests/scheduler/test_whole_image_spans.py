"""An image's span is computed in one step (services/scheduler/encoder_budget.py): a chunk
never ends inside it (Gemma 3's image tokens attend to the whole image, so every key of it
must be in the cache when its rows attend), but for a span longer than a step's tokens for
one request, which only a split runs; a prefix hit that would end inside a span is cut
back to the span's block."""

from services.common.image_input import ImageInput
from services.scheduler.encoder_budget import ends_inside_image, fit_chunk
from tests.scheduler.stand_in_worker import make_request, run_to_completion

IMAGE = 7


def image_prompt(spans: list[tuple[int, int]], total: int) -> list[int]:
    ids = [(11 * i) % 97 + 20 for i in range(total)]
    for offset, length in spans:
        ids[offset : offset + length] = [IMAGE] * length
    return ids


def with_images(request_id: str, spans: list[tuple[int, int]], total: int, content="cat"):
    request = make_request(request_id, image_prompt(spans, total), 16, max_tokens=2)
    request.images = tuple(ImageInput(o, n, n, f"{content}{o}") for o, n in spans)
    request.block_hashes = []
    request.update_block_hashes()
    return request


def test_fit_chunk_never_ends_inside_a_span():
    images = (ImageInput(10, 20, 20, "x"), ImageInput(40, 20, 20, "y"))
    assert ends_inside_image(images, 11) and ends_inside_image(images, 59)
    assert not any(ends_inside_image(images, end) for end in (10, 30, 40, 60))
    # budget for both images; the chunk's token cap would end it inside y
    assert fit_chunk(images, 0, 50, False, 100, True, max_chunk=50) == (40, 20)
    assert fit_chunk(images, 0, 25, False, 100, True, max_chunk=50) == (10, 0)
    assert fit_chunk(images, 10, 15, False, 100, True, max_chunk=50) == (0, 0)  # waits
    # a span longer than max_chunk is split: it could not run otherwise
    assert fit_chunk(images, 10, 15, False, 100, True, max_chunk=15) == (15, 20)
    # a chunk that starts inside a span (its earlier part computed) is not cut back
    assert fit_chunk(images, 12, 10, False, 100, True, max_chunk=50) == (10, 0)


def test_chunked_prefill_schedules_each_span_whole(build):
    scheduler, worker = build(num_blocks=64, max_num_batched_tokens=32)
    request = with_images("r", [(20, 24), (50, 8)], 70)
    scheduler.add_request(request)
    chunks = []
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        start = request.num_computed_tokens - plan.num_scheduled_tokens.get("r", 0)
        if plan.num_scheduled_tokens and start < request.num_prompt_tokens:
            chunks.append((start, plan.num_scheduled_tokens["r"]))
        scheduler.update_from_output(plan, worker.execute(plan))
    # 32 tokens would end inside the first span: cut at 20; then the first span whole and
    # up to the second (52 would be inside it); then the second whole and the rest
    assert chunks == [(0, 20), (20, 30), (50, 20)]
    assert not any(ends_inside_image(request.images, s + n) for s, n in chunks)


def test_a_span_waits_for_a_step_with_room(build):
    """Another request's prefill leaves too little of the step for the span: the chunk
    stops before it and the span runs whole in the next step."""
    scheduler, worker = build(num_blocks=64, max_num_batched_tokens=40)
    first = make_request("first", list(range(20, 50)), 16, max_tokens=4)
    scheduler.add_request(first)
    second = with_images("second", [(4, 24)], 40)
    scheduler.add_request(second)
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"first": 30, "second": 4}
    scheduler.update_from_output(plan, worker.execute(plan))
    plan = scheduler.schedule()
    # first decodes one token; second's span and the rest of its prompt fit the 39 left
    assert plan.num_scheduled_tokens == {"first": 1, "second": 36}
    scheduler.update_from_output(plan, worker.execute(plan))
    run_to_completion(scheduler, worker)
    assert first.is_finished and second.is_finished


def test_a_prefix_hit_inside_a_span_is_cut_back_to_its_block(build):
    scheduler, worker = build(num_blocks=64)
    scheduler.add_request(with_images("first", [(20, 24)], 80))
    run_to_completion(scheduler, worker)
    # the same image; the prompt ends (less its last token) inside the span's blocks:
    # a hit of 2 blocks (32 positions) would end inside 20..43, so it is block 0 alone
    again = with_images("again", [(20, 24)], 36)  # the first 36 tokens of first's prompt
    scheduler.add_request(again)
    scheduler.schedule()
    assert again.num_cached_tokens == 16
    # a prompt past the span hits every full block (the span's among them)
    later = with_images("later", [(20, 24)], 80)
    scheduler.add_request(later)
    scheduler.schedule()
    assert later.num_cached_tokens == 64
