"""Images in the engine core: their content hashes in the block hashes (prefix hits only
on the same image) and the step's encoder budget (a chunk cut before an image that does
not fit; an image larger than the budget runs alone)."""

from services.common.image_input import ImageInput
from services.scheduler.encoder_budget import fit_chunk, images_to_encode
from tests.scheduler.stand_in_worker import make_request, run_to_completion

IMAGE = 7  # the image token id of these prompts


def image_prompt(offset: int, num_embeds: int, total: int) -> list[int]:
    ids = [(11 * i) % 97 + 20 for i in range(total)]
    ids[offset : offset + num_embeds] = [IMAGE] * num_embeds
    return ids


def image(offset: int, num_embeds: int, content: str) -> ImageInput:
    return ImageInput(offset, num_embeds, num_embeds, content)


def with_images(request_id, prompt, images, block_size=16, **params):
    request = make_request(request_id, prompt, block_size, max_tokens=2, **params)
    request.images = tuple(images)
    request.block_hashes = []
    request.update_block_hashes()
    return request


def test_blocks_touching_an_image_hash_its_content():
    prompt = image_prompt(20, 24, 64)  # the span covers positions 20..43: blocks 1 and 2
    a = with_images("a", prompt, [image(20, 24, "cat")])
    b = with_images("b", prompt, [image(20, 24, "dog")])
    same = with_images("c", prompt, [image(20, 24, "cat")])
    assert a.block_hashes[0] == b.block_hashes[0]  # before the image: text alone
    assert a.block_hashes[1] != b.block_hashes[1] and a.block_hashes[2] != b.block_hashes[2]
    assert a.block_hashes[3] != b.block_hashes[3]  # chained after the image
    assert a.block_hashes == same.block_hashes


def test_prefix_hits_only_on_the_same_image(build):
    scheduler, worker = build(num_blocks=64)
    prompt = image_prompt(20, 24, 64)
    first = with_images("first", prompt, [image(20, 24, "cat")])
    scheduler.add_request(first)
    run_to_completion(scheduler, worker)
    other = with_images("other", prompt, [image(20, 24, "dog")])
    scheduler.add_request(other)
    scheduler.schedule()
    assert other.num_cached_tokens == 16  # block 0 only: it holds no image position
    again = with_images("again", prompt, [image(20, 24, "cat")])
    scheduler.add_request(again)
    scheduler.schedule()
    assert again.num_cached_tokens == 48  # every full block of the prompt but the last


def test_a_chunk_is_cut_before_an_image_over_the_step_budget(build):
    scheduler, worker = build(num_blocks=64, max_num_batched_tokens=100)
    a = with_images("a", image_prompt(10, 60, 80), [image(10, 60, "a")])
    b = with_images("b", image_prompt(5, 60, 70), [image(5, 60, "b")])
    scheduler.add_request(a)
    scheduler.add_request(b)
    plan = scheduler.schedule()
    # a's 80 tokens (its 60 embeddings), then b up to its image: 60 more would exceed 100
    assert plan.num_scheduled_tokens == {"a": 80, "b": 5}
    new = {n.request_id: n for n in plan.scheduled_new_reqs}
    assert new["a"].images == a.images
    scheduler.update_from_output(plan, worker.execute(plan))
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens["b"] == 65  # its image now, with the budget untouched
    scheduler.update_from_output(plan, worker.execute(plan))
    run_to_completion(scheduler, worker)
    assert a.is_finished and b.is_finished


def test_an_image_larger_than_the_budget_runs_alone(build):
    scheduler, worker = build(num_blocks=64, max_num_batched_tokens=32)
    big = with_images("big", image_prompt(4, 40, 60), [image(4, 40, "big")])
    scheduler.add_request(big)
    plans = []
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        plans.append(dict(plan.num_scheduled_tokens))
        scheduler.update_from_output(plan, worker.execute(plan))
    assert plans[0] == {"big": 32}  # chunked through the image, encoded once up front
    assert sum(p.get("big", 0) for p in plans[:2]) == 60


def test_images_to_encode_and_fit_chunk():
    images = (image(10, 20, "x"), image(40, 20, "y"))
    # a chunk from inside x's span needs x again only when the worker lacks the request
    assert images_to_encode(images, 15, 30, fresh=False) == [images[1]]
    assert images_to_encode(images, 15, 30, fresh=True) == list(images)
    assert fit_chunk(images, 0, 70, False, 30, True) == (40, 20)  # cut before y
    assert fit_chunk(images, 15, 30, True, 30, True) == (25, 20)
    assert fit_chunk(images, 0, 70, False, 10, False) == (10, 0)  # nothing left for x
