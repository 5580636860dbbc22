"""muon.py: the Newton-Schulz iteration and the Muon optimizer, single-process and under FSDP2."""
import ast
import copy
import inspect
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate

import muon
from muon import Muon, orthogonalize

# Published constants as literals (a test reading muon.py's own table would hold it equal to itself).
# KellerJordan/Muon @ 857d1ad: 5 steps of (a, b, c) on X / (||X||_F + 1e-7); momentum 0.95, Nesterov,
# update * max(1, rows/cols)^0.5.
KELLER_JORDAN_NS = (3.4445, -4.7750, 2.0315)
# qlabs-eng/scaling-exponents @ 9139c39, models/optimizer.py: X / (||X||_F * 1.02 + 1e-6), MuonEq-R
# clamp 1e-7, second moment clamp 1e-10, momentum = beta2 = 0.95, 5 steps; lr * max(1, rows/cols)^0.5.
X_POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def test_muon_takes_the_published_constants(monkeypatch):
    assert muon.NS_COEFFICIENTS == KELLER_JORDAN_NS
    assert tuple(map(tuple, muon.POLAR_EXPRESS)) == X_POLAR_EXPRESS
    defaults = {k: v.default for k, v in inspect.signature(Muon).parameters.items()}
    published = dict(momentum=0.95, nesterov=True, ns_steps=5, beta2=0.95)
    assert {k: defaults[k] for k in published} == published
    assert inspect.signature(orthogonalize).parameters["eps"].default == 1e-7  # Keller Jordan's
    assert muon.muon_lr_scale((12, 3)) == 2.0 and muon.muon_lr_scale((3, 12)) == 1.0
    # MuonEq-R: row norms clamped at 1e-7
    torch.testing.assert_close(muon.row_normalize(torch.tensor([[1e-9, 0.0], [3.0, 4.0]])),
                               torch.tensor([[1e-2, 0.0], [0.6, 0.8]]))
    # what the x variant hands the iteration
    calls, bind = [], inspect.signature(orthogonalize).bind
    monkeypatch.setattr(muon, "orthogonalize", lambda *a, **k: calls.append(bind(*a, **k).arguments))
    Muon([torch.zeros(2, 2)], variant="x").orthogonalize(torch.ones(2, 2), 5)
    call = calls[0]
    assert (call["eps"], tuple(map(tuple, call["coefficients"])), call["norm_scale"]) == (
        1e-6, X_POLAR_EXPRESS, 1.02)


def test_orthogonalize_in_bf16_is_within_5_percent_of_fp32():
    """bf16 (CUDA's arithmetic, on CPU) keeps 8 significant bits, compounded by five steps: within 5% of
    the fp32 result (about 4% observed; fp32's: test_orthogonalize_is_close_to_the_polar_factor). Stacked
    experts are each orthogonalised on their own."""
    g = torch.Generator().manual_seed(0)
    for shape in [(64, 32), (32, 64), (48, 48), (4, 48, 16)]:  # the last: experts (E, out, in)
        m = torch.randn(*shape, generator=g)
        low, full = orthogonalize(m, dtype=torch.bfloat16), orthogonalize(m)
        assert low.dtype == torch.float32 and (low - full).norm() / full.norm() < 0.05, shape
    experts = torch.randn(3, 24, 40, generator=g)
    torch.testing.assert_close(orthogonalize(experts), torch.stack([orthogonalize(e) for e in experts]))


def stepped(params, grads, **settings):
    """(copies of params after a Muon step per list of grads, the optimizer)."""
    params = [p.clone() for p in params]
    opt = Muon(params, **settings)
    for step_grads in grads:
        for p, grad in zip(params, step_grads):
            p.grad = grad.clone()
        opt.step()
    return params, opt


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_step_is_the_formula(nesterov):
    """Two steps against the formula written out: buf <- m buf + g; g + m buf (Nesterov) or buf,
    orthogonalised, times lr max(1, rows/cols)^0.5, after p <- p (1 - lr wd). Same operations in the
    same order: fp32 round-off only."""
    lr, momentum, wd = 0.05, 0.9, 0.1
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(6, 3, generator=g), torch.randn(2, 4, 5, generator=g)]  # tall; experts
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(2)]
    expected, buffers = [p.clone() for p in params], [torch.zeros_like(p) for p in params]
    for step_grads in grads:
        for p, buf, grad in zip(expected, buffers, step_grads):
            buf.copy_(momentum * buf + grad)
            update = grad + momentum * buf if nesterov else buf
            scale = max(1.0, p.shape[-2] / p.shape[-1]) ** 0.5
            p.copy_(p * (1 - lr * wd) - lr * scale * orthogonalize(update))
    actual, _ = stepped(params, grads, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=wd)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("variant", ["original", "x"])
def test_stacked_gate_and_up_step_as_two_matrices(variant):
    """model.MoE's (E, 2, hidden, n_embd) gate-and-up steps as its two halves given apart."""
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(3, 2, 5, 8, generator=g)
    grads = [torch.randn(stacked.shape, generator=g) for _ in range(2)]
    settings = dict(lr=0.05, weight_decay=0.1, variant=variant)
    (whole,), _ = stepped([stacked], [[grad] for grad in grads], **settings)
    halves, _ = stepped(stacked.unbind(1), [grad.unbind(1) for grad in grads], **settings)
    torch.testing.assert_close(whole, torch.stack(halves, 1), rtol=0, atol=1e-6)


def x_muon_reference(params, grads, lr, momentum, wd, beta2):
    """The [X] code's muon_step_fused written out per matrix, in fp32, with its tall / wide formulas."""
    params = [p.clone() for p in params]
    buffers = [torch.zeros_like(p) for p in params]
    seconds = [torch.zeros(*p.shape[:-1], 1) if p.shape[-2] >= p.shape[-1] else
               torch.zeros(*p.shape[:-2], 1, p.shape[-1]) for p in params]
    for step_grads in grads:
        for p, buf, second, g in zip(params, buffers, seconds, step_grads):
            rows, cols = p.shape[-2:]
            buf.lerp_(g, 1 - momentum)
            u = g.lerp(buf, momentum)  # Nesterov
            u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-7)  # MuonEq-R
            x = u / (u.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
            for a, b, c in X_POLAR_EXPRESS:
                if rows > cols:
                    A = x.mT @ x
                    x = a * x + x @ (b * A + c * (A @ A))
                else:
                    A = x @ x.mT
                    x = a * x + (b * A + c * (A @ A)) @ x
            red = -1 if rows >= cols else -2
            v = x.square().mean(dim=red, keepdim=True)
            n = x.size(red)
            v_norm = (v.sum(dim=(-2, -1), keepdim=True) * n).sqrt()
            second.lerp_(v, 1 - beta2)
            step = second.clamp_min(1e-10).rsqrt()
            v_new = (v * n * step.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
            x = x * step * (v_norm / v_new.clamp_min(1e-10))
            scaled_lr = lr * max(1.0, rows / cols) ** 0.5
            p.sub_(scaled_lr * x + scaled_lr * wd * p * ((x * p) >= 0))  # cautious weight decay
    return params


def test_x_variant_is_the_published_algorithm_step_by_step():
    """Three steps on tall, wide, square, two of one shape (one batch) and stacked experts against the
    reference: fp32 round-off in another order, amplified by coefficients up to 22: 1e-4."""
    lr, momentum, wd, beta2 = 0.05, 0.9, 0.1, 0.95
    g = torch.Generator().manual_seed(0)
    shapes = [(6, 3), (6, 3), (3, 7), (4, 4), (2, 5, 3)]
    params = [torch.randn(*shape, generator=g) / 2 for shape in shapes]
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(3)]
    expected = x_muon_reference(params, grads, lr, momentum, wd, beta2)
    actual, opt = stepped(params, grads, lr=lr, momentum=momentum, weight_decay=wd, variant="x",
                          beta2=beta2, ns_dtype=torch.float32)
    for a, e, shape in zip(actual, expected, shapes):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4, msg=lambda m: f"{shape}: {m}")
    assert not torch.equal(actual[0], params[0])
    assert opt.state[actual[2]]["second_momentum_buffer"].shape == (1, 7)  # wide: per column


def test_orthogonalize_is_close_to_the_polar_factor():
    """Against the SVD m = U S V^T: U^T result V is the scalar map of S within 4.4e-6 (Polar Express) and
    6.5e-7 (Newton-Schulz); a coefficient 0.1% off is 1.7e-4 off. U V^T is 0.085-0.23 away."""
    g = torch.Generator().manual_seed(1)
    for shape in [(64, 32), (32, 64), (48, 48)]:
        m = torch.randn(*shape, generator=g)
        u, s, vh = torch.linalg.svd(m.double(), full_matrices=False)
        polar_express = Muon([m], variant="x", ns_dtype=torch.float32).orthogonalize(m, 5)  # muon.py's table
        for result, coefficients, norm_scale, eps, far in (
                (orthogonalize(m), [KELLER_JORDAN_NS] * 5, 1.0, 1e-7, 0.28),
                (polar_express, X_POLAR_EXPRESS, 1.02, 1e-6, 0.12)):
            # each singular value's path: U S V^T -> U (a S + b S^3 + c S^5) V^T
            x = s / (norm_scale * s.norm() + eps)
            for a, b, c in coefficients:
                x = a * x + b * x ** 3 + c * x ** 5
            expected = torch.diag(x)
            assert (u.mT @ result.double() @ vh.mT - expected).abs().max() < 5e-5, (shape, coefficients)
            assert (result.double() - u @ vh).norm() / (u @ vh).norm() < far, shape


class Net(nn.Module):
    """Rows uneven across 2 ranks, one single row (rank 1 holds none), experts E = 3 (2 + 1) and 1."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)  # (8, 8): 4 + 4 rows
        self.b = nn.Linear(8, 5, bias=False)  # (5, 8): 3 + 2 rows
        self.c = nn.Linear(3, 7, bias=False)  # (7, 3): tall (lr scale 7/3 ^ 0.5), 4 + 3 rows
        self.head = nn.Linear(5, 1, bias=False)  # (1, 5): 1 + 0 rows
        self.experts = nn.Parameter(torch.randn(3, 6, 4) / 2)  # (E, out, in)
        self.expert = nn.Parameter(torch.randn(1, 4, 4) / 2)

    def forward(self, x):  # x (B, 8)
        h = self.b(torch.tanh(self.a(x)))  # (B, 5)
        y = self.c(h[:, :3])  # (B, 7)
        z = torch.einsum("bi,eoi->beo", y[:, :4], self.experts)  # (B, 3, 6)
        w = torch.einsum("bi,eoi->beo", z[:, 0, :4], self.expert)  # (B, 1, 4)
        return self.head(h).square().mean() + z.square().mean() + w.square().mean()


def train_steps(model, optimizer, steps):
    """A step per step in `steps`, its batch seeded by the step: the same on every rank."""
    for step in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model(x).backward()
        optimizer.step()
        optimizer.zero_grad()


def check_sharded_muon(rank, mesh, ns_dtype, checkpoint_dir, variant="original"):
    settings = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1, ns_dtype=ns_dtype, variant=variant)
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    train_steps(reference, Muon(reference.parameters(), **settings), range(3))

    for module in (model.a, model.b, model.c, model.head, model):
        fully_shard(module, mesh=mesh)
    opt, orthogonalised = Muon(model.parameters(), **settings), []

    def recording(update, steps):
        orthogonalised.append(tuple(update.shape))
        return Muon.orthogonalize(opt, update, steps)
    opt.orthogonalize = recording
    train_steps(model, opt, range(2))

    # the momentum is sharded like its parameter
    for p in model.parameters():
        buf = opt.state[p]["momentum_buffer"]
        assert isinstance(buf, DTensor) and buf.placements == p.placements
        assert buf.to_local().shape == p.to_local().shape, (p.shape, buf.to_local().shape)

    # each (out, in) matrix (told apart by its shape) is orthogonalised whole by its owner alone;
    # experts where they are
    assert sorted(tuple(p.shape) for p in opt.owners) == [(1, 5), (5, 8), (7, 3), (8, 8)]
    mine = [tuple(p.shape) for p, owner in opt.owners.items() if owner == rank]
    assert sorted(s for s in orthogonalised if len(s) == 2) == sorted(2 * mine)  # 2 steps
    everyone = [None] * mesh.size()
    dist.all_gather_object(everyone, mine)
    assert sorted(sum(everyone, [])) == sorted(tuple(p.shape) for p in opt.owners)  # disjoint, covering
    local_experts = [tuple(model.experts.to_local().shape), tuple(model.expert.to_local().shape)]
    assert local_experts == ([(2, 6, 4), (1, 4, 4)] if rank == 0 else [(1, 6, 4), (0, 4, 4)])
    held = [s for s in local_experts if s[0] > 0]  # rank 1 holds no expert of `expert`: nothing to do
    experts = [s[1:] for s in orthogonalised if len(s) == 4] if variant == "x" else \
        [s for s in orthogonalised if len(s) == 3]  # the x variant stacks whole matrices of one shape
    assert sorted(experts) == sorted(2 * held)

    # the sharded state survives a torch.distributed.checkpoint round trip; the fresh Muon steps on
    dcp.save(get_optimizer_state_dict(model, opt), checkpoint_id=checkpoint_dir)
    fresh = Muon(model.parameters(), **settings)
    state = get_optimizer_state_dict(model, fresh)  # its zero-lr step makes the state to load into
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_optimizer_state_dict(model, fresh, state)
    for p in model.parameters():
        loaded, saved = fresh.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"]
        assert loaded.placements == p.placements and torch.equal(loaded.to_local(), saved.to_local())
        if variant == "x":  # the second moment: sharded by rows (tall, square) or replicated (wide)
            loaded, saved = fresh.state[p]["second_momentum_buffer"], opt.state[p]["second_momentum_buffer"]
            wide = p.shape[-2] < p.shape[-1]
            if p.ndim == 2:
                assert loaded.placements == saved.placements == ((Replicate(),) if wide else p.placements)
            assert torch.equal(loaded.to_local(), saved.to_local())
    train_steps(model, fresh, range(2, 3))

    # the sharded run equals one process (0 difference observed on 2 ranks). The tolerance allows FSDP2's
    # gradient average to round (2e-6 on 3 ranks), which in bf16 can flip a rounding (2^-9) x lr 0.1.
    tolerance = 1e-5 if ns_dtype == torch.float32 else 1e-3
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=tolerance, atol=tolerance,
                                   msg=lambda m: f"{name}, Newton-Schulz in {ns_dtype}: {m}")


def fsdp_worker(rank, world, folder):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (world,))
        for ns_dtype in (torch.float32, torch.bfloat16):  # bf16: as on CUDA, the shards travel in bf16
            check_sharded_muon(rank, mesh, ns_dtype, f"{folder}/{ns_dtype}")
        check_sharded_muon(rank, mesh, torch.float32, f"{folder}/x", variant="x")  # [X] code's Muon
    finally:
        dist.destroy_process_group()
    # Every check passed. A gloo thread FSDP2 keeps alive can abort Python's shutdown (torch 2.13).
    os._exit(0)


def test_muon_under_fsdp2_matches_one_process(tmp_path):
    """Muon on FSDP2-sharded parameters (2 gloo processes) takes the same steps as on whole tensors."""
    context = mp.start_processes(fsdp_worker, args=(2, str(tmp_path)), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):  # a worker's exception is raised here, with its traceback
        if time.monotonic() > deadline:
            for process in context.processes:
                process.terminate()
            pytest.fail("2-process FSDP2 Muon test hung for 120 s (a collective not matched across ranks?)")


@pytest.mark.parametrize("variant", ["original", "x"])
def test_the_single_process_muon_copied_alone_steps_as_muon(variant):
    """muon.py down to its distributed divider, alone in a module importing only torch, is a whole Muon:
    two steps on Net's matrices equal muon.Muon's."""
    source = inspect.getsource(muon)
    alone = source[:source.index("\n# --- distributed")]
    tree = ast.parse(alone)
    imports = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert imports == ["import torch"]
    namespace = {}
    exec(compile(tree, "muon_alone", "exec"), namespace)
    torch.manual_seed(0)
    models = [net := Net(), copy.deepcopy(net)]
    for model, cls in zip(models, (namespace["Muon"], Muon)):
        assert (cls is Muon) == hasattr(cls, "owners")
        train_steps(model, cls(model.parameters(), lr=0.1, weight_decay=0.1, variant=variant), range(2))
    for (name, a), (_, b) in zip(*(m.named_parameters() for m in models)):
        assert torch.equal(a, b), name
