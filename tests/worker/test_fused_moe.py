"""The mixture of experts (services/worker/layers/fused_moe.py) against a per-token torch
reference: routing with and without renormalisation, the shared expert, and expert
parallelism's placement (two ranks' partial sums add up to the whole)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from services.worker.layers import fused_moe
from services.worker.layers.fused_moe import FusedMoE, expert_range, route
from tests.helpers.tiny_moe import HIDDEN, moe_spec, randomized


def reference(moe: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over all experts, the top k, each expert's gated MLP."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ moe.gate.weight.T, dim=-1)
        top = torch.topk(probs, moe.top_k)
        weights = top.values / top.values.sum() if moe.renormalize else top.values
        for w, j in zip(weights, top.indices, strict=True):
            expert = moe.experts[int(j)]
            gate, up = (x[t] @ expert.gate_up_proj.weight.T).chunk(2)
            out[t] += w * ((F.silu(gate) * up) @ expert.down_proj.weight.T)
        if moe.shared_expert is not None:
            shared = moe.shared_expert
            gate, up = (x[t] @ shared.gate_up_proj.weight.T).chunk(2)
            scale = torch.sigmoid(x[t] @ moe.shared_expert_gate.weight.T)
            out[t] += scale * ((F.silu(gate) * up) @ shared.down_proj.weight.T)
    return out


def test_route_keeps_the_top_k_and_renormalises_where_asked():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
    weights, experts = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert experts.tolist() == [[1, 2], [0, 3]]
    torch.testing.assert_close(weights, probs.gather(1, experts))
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


@pytest.mark.parametrize(("shared", "renormalize"), [(0, True), (40, False)])
def test_fused_moe_equals_the_per_token_reference(shared, renormalize):
    moe = randomized(FusedMoE(moe_spec(shared, renormalize), HIDDEN), seed=1)
    x = torch.randn(19, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), reference(moe, x), atol=1e-5, rtol=1e-5)


def test_expert_parallel_ranks_hold_whole_experts_whose_sums_add_up(monkeypatch):
    full = randomized(FusedMoE(moe_spec(), HIDDEN), seed=3)
    monkeypatch.setattr(fused_moe, "tp_all_reduce", lambda tensor: None)  # summed below
    x = torch.randn(23, HIDDEN, generator=torch.Generator().manual_seed(4))
    partial = []
    for rank in range(2):
        part = FusedMoE(moe_spec(), HIDDEN, tp_rank=rank, tp_size=2, expert_parallel=True)
        assert part.local_experts == range(3 * rank, 3 * rank + 3)
        for j, expert in enumerate(part.experts):
            if j in part.local_experts:  # whole, not a slice
                assert expert.gate_up_proj.weight.shape == (48, HIDDEN)
                expert.load_state_dict(full.experts[j].state_dict())
            else:
                assert isinstance(expert, torch.nn.Identity)
        part.gate.load_state_dict(full.gate.state_dict())
        with torch.no_grad():
            partial.append(part(x))
    with torch.no_grad():
        torch.testing.assert_close(partial[0] + partial[1], full(x), atol=1e-5, rtol=1e-5)


def test_expert_parallel_needs_the_ranks_to_divide_the_experts():
    with pytest.raises(ValueError, match="divide the model's 6 experts"):
        expert_range(6, 0, 4)


def test_align_by_expert_pads_each_experts_run_to_whole_blocks():
    from pagestream_kernels.triton.fused_moe import align_by_expert

    experts = torch.tensor([[2, 0], [2, -1], [0, 2]])  # slots 0..5; slot 3 dropped
    slots, block_expert = align_by_expert(experts, num_experts=3, block_m=4)
    pad = 6
    assert block_expert.tolist() == [0, 2]  # expert 1 has no slot, no block
    assert slots.tolist() == [1, 4, pad, pad, 0, 2, 5, pad]
