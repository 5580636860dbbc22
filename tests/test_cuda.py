"""What only a CUDA device can check, skipped without one (bench/gpu_check.sh runs it in its correctness stage).

The MoE's grouped GEMM on CUDA: model.run_experts calls torch's grouped_mm kernel (bf16 only on CUDA), with
each expert's group padded to 8 rows (group_align=8, the CUDA default) or not (group_align=1). Held to the
per-expert loop (conftest.loop_experts: cuBLAS matmuls, one expert at a time) in bf16, under autocast and in
plain bf16 tensors, forward and every gradient, with experts of 0 and 1 tokens among them: the grouped path
is as accurate as the loop against an fp32 reference, and an expert without tokens gets exactly zero weight
gradients (an empty group the kernel must still write).
"""
import pytest
import torch

from conftest import loop_experts
from model import run_experts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

COUNTS = [[0, 1, 40, 0, 1, 7, 130, 3], [1, 0, 0, 0, 0, 0, 0, 181], [0, 0, 0, 0, 0, 0, 0, 1]]


def expert_inputs(counts, width, hidden, device, seed=0):
    """x (tokens, width), token_of (assignments sorted by expert), counts, the three expert stacks and the
    router weights, in fp32 on `device`; tokens appear up to twice (top-2)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    n_tokens = max(1, (n + 1) // 2)
    x = torch.randn(n_tokens, width, generator=g)
    token_of = torch.randperm(2 * n_tokens, generator=g)[:n] // 2
    experts = len(counts)
    weights = [torch.randn(experts, hidden, width, generator=g) / width ** 0.5,
               torch.randn(experts, hidden, width, generator=g) / width ** 0.5,
               torch.randn(experts, width, hidden, generator=g) / hidden ** 0.5]
    row_weights = torch.rand(n, generator=g)
    upstream = torch.randn(n_tokens, width, generator=g)
    return [t.to(device) for t in (x, token_of, torch.tensor(counts), *weights, row_weights, upstream)]


def forward_and_grads(experts, inputs, dtype, autocast):
    """[output, d x, d w_gate, d w_up, d w_down, d row_weights], in fp32, of experts(...) with the float inputs
    in `dtype` (autocast: fp32 tensors under bf16 autocast, as the model runs)."""
    x, token_of, counts, *weights, row_weights, upstream = inputs
    leaves = [t.to(dtype).requires_grad_(True) for t in (x, *weights, row_weights)]
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = experts(leaves[0], token_of, counts, *leaves[1:4], leaves[4])
    grads = torch.autograd.grad(y, leaves, upstream.to(y.dtype))
    return [t.float() for t in (y, *grads)]


def check_grouped_experts(device, counts, width, hidden, group_align, mode):
    inputs = expert_inputs(counts, width, hidden, device)
    dtype, autocast = (torch.float32, True) if mode == "autocast" else (torch.bfloat16, False)
    exact = forward_and_grads(loop_experts, inputs, torch.float32, False)
    loop = forward_and_grads(loop_experts, inputs, dtype, autocast)
    grouped = forward_and_grads(lambda *a: run_experts(*a, group_align=group_align), inputs, dtype, autocast)
    names = ("y", "d x", "d w_gate", "d w_up", "d w_down", "d row_weights")
    for name, e, lo, gr in zip(names, exact, loop, grouped):
        scale = e.abs().max().item() + 1e-12
        assert (gr - lo).abs().max().item() <= scale * 2 ** -6, name  # the loop's own bf16 result, within ~2 roundings
        assert (gr - e).abs().max().item() <= 2 * (lo - e).abs().max().item() + scale * 2 ** -10, name  # as accurate
    empty = torch.tensor(counts, device=device) == 0
    for name, gr in zip(names[2:5], grouped[2:5]):
        assert torch.equal(gr[empty], torch.zeros_like(gr[empty])), f"{name}: an expert without tokens"


@pytest.mark.parametrize("mode", ["autocast", "bf16"])
@pytest.mark.parametrize("group_align", [1, 8])
@pytest.mark.parametrize("width, hidden", [(64, 48), (33, 19)])  # 33, 19: rows not 16-byte aligned, zero-padded
@pytest.mark.parametrize("counts", COUNTS, ids=["mixed", "one-and-many", "single-token"])
def test_cuda_grouped_experts_equal_the_per_expert_loop(counts, width, hidden, group_align, mode):
    check_grouped_experts("cuda", counts, width, hidden, group_align, mode)
