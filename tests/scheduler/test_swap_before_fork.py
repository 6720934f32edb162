"""Found while testing speculative decoding: an n > 1 group's parent swapped out after its
prefill but before its fork came back in a plan row of 0 tokens, which the worker refuses
when the plan has other rows (async scheduling made it common). Preempted with nothing to
compute, it is recomputed instead; outputs are unchanged."""

from services.common.config import CacheConfig, SchedulerConfig
from services.scheduler.scheduler import Scheduler
from tests.scheduler.stand_in_worker import (
    StandInWorker,
    make_request,
    reference_generate,
    run_to_completion,
)


def test_an_unforked_parent_is_never_swapped_into_an_empty_row():
    # 6 blocks of 4: "a" (16 tokens) decodes into a 5th block while "g" (n = 2) holds 2
    # blocks with 7 of its 8 prompt tokens computed, waiting to fork.
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=64, preemption_mode="swap"),
        CacheConfig(block_size=4),
        num_device_blocks=6,
        num_cpu_blocks=16,
    )
    worker = StandInWorker(6, 4, 16)
    a = make_request("a", [1] * 16, 4, max_tokens=3, ignore_eos=True)
    g = make_request("g", [2] * 8, 4, n=2, seed=1, max_tokens=4, ignore_eos=True)
    scheduler.add_request(a)
    scheduler.add_request(g)
    plans, sequences = [], {}
    while scheduler.has_unfinished_requests():
        sequences.update(scheduler.requests)
        plans.append(scheduler.schedule())
        scheduler.update_from_output(plans[-1], worker.execute(plans[-1]))
    assert plans[0].num_scheduled_tokens == {"a": 16, "g": 7}
    assert scheduler.num_preemptions > 0  # a needed a 5th block: g, the newest, went
    for plan in plans:  # the worker refuses a row of 0 tokens beside others
        assert all(n >= 1 for n in plan.num_scheduled_tokens.values()), plan
    assert run_to_completion(scheduler, worker) == {}
    for sequence in sequences.values():
        expected = reference_generate(sequence.prompt_token_ids, sequence.sampling_params, 64)
        assert sequence.output_token_ids == expected, sequence.request_id
    assert {"g", "g#1"} <= set(sequences)
    assert scheduler.kv.num_free_blocks == 6 and len(scheduler.kv.cpu_free) == 16
