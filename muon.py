"""
Muon: MomentUm Orthogonalized by Newton-Schulz (Keller Jordan; as in modded-nanogpt and nanochat), for
the hidden matrices of a transformer. One file with no project imports: copy it into any project.

    from muon import Muon
    opt = Muon(hidden_matrices, lr=0.02, momentum=0.95)      # 2-D (out, in) or stacked experts (E, out, in)
    opt = Muon(hidden_matrices, lr=0.04, variant="x", weight_decay=0.07)   # the [X] paper code's Muon

Two variants, each a function updating one matrix top to bottom (read them side by side):
original_update: SGD momentum (Nesterov by default), orthogonalised by five steps of the quintic
Newton-Schulz iteration (orthogonalize), scaled by lr * max(1, rows/cols)^0.5 so that tall matrices get
the same RMS update per element; decoupled weight decay p <- p (1 - lr wd).
x_update: the Muon the [X] paper's code trains with (qlabs-eng/scaling-exponents, models/optimizer.py):
momentum as an EMA, rows to unit norm (MuonEq-R), 5 Polar Express steps, variance reduction (NorMuon-like),
cautious weight decay; matrices of one shape orthogonalised in one batched call, as the [X] code does.
A stacked expert tensor (E, out, in) is orthogonalised per expert. The iteration's Gram product is
`opt.gram` (None: x @ x.mT); kernels.apply(model, ..., [opt]) sets it to a half-tile Triton kernel.

FSDP2: the same class takes parameters that are DTensors sharded on a 1-D mesh (fully_shard). Momentum
is elementwise, so it runs on the local shard and its buffer stays sharded (a DTensor like the grad).
Newton-Schulz needs whole matrices: each (out, in) matrix split across ranks has one owner rank
(owners()); every rank sends the owner its shard of the update, the owner orthogonalises the whole
matrix and sends every rank its shard of the result back. Stacked experts sharded on E hold whole
experts on each rank: they are orthogonalised where they are, with no communication. The collectives
pair up across ranks, so every rank must step with grads on the same parameters (as FSDP2 gives).
The momentum buffers are DTensors: torch.distributed.checkpoint saves and loads them sharded.
Plain tensors (single process, DDP) take the same path, with no communication. All of it is in Muon.step
and the helpers it calls: the two updates see this rank's local tensors only.
"""

import contextlib
import functools
import sys
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic (a, b, c): maximal slope at 0, 5 steps suffice
POLAR_EXPRESS = (  # the [X] code's 5 steps, each its own (a, b, c) (Polar Express, Amsel et al. 2025)
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def newton_schulz_dtype(update):
    """The default Newton-Schulz arithmetic dtype: bfloat16 on CUDA (as the references), float32
    elsewhere (CPUs have no fast bf16)."""
    return torch.bfloat16 if update.is_cuda else torch.float32


def orthogonalize(update, steps=5, eps=1e-7, dtype=None, gram=None, coefficients=None, norm_scale=1.0):
    """Newton-Schulz quintic iteration: X <- a X + (b A + c A^2) X with A = X X^T, `steps` times, after
    X = G / ||G||_F (so every singular value starts <= 1). The coefficients maximise the slope at 0, so
    small singular values grow fast; the result is U S' V^T with S' in ~[0.7, 1.2], not exactly 1,
    which is all Muon needs. Batched over leading dims: a stacked expert tensor (E, out, in) is
    orthogonalised per expert.
    dtype: the arithmetic dtype; None -> newton_schulz_dtype (bf16 on CUDA, fp32 elsewhere). Pass
    torch.bfloat16 on CPU to rehearse the CUDA arithmetic.
    gram: x -> x @ x.mT for both Gram products of each step (A = X X^T, and A A = A A^T: A is
    symmetric); None -> the plain matmul. Muon passes its `gram` attribute (kernels.gram: a Triton
    kernel computing half the tiles).
    coefficients: one (a, b, c) per step (POLAR_EXPRESS for the [X] variant); None: NS_COEFFICIENTS every
    step. norm_scale: X = G / (norm_scale ||G||_F + eps) ([X] code: 1.02 and eps 1e-6)."""
    coefficients = coefficients or [NS_COEFFICIENTS] * steps
    dtype = dtype or newton_schulz_dtype(update)
    gram = gram or (lambda x: x @ x.mT)
    x = update.to(dtype)
    transposed = x.size(-2) > x.size(-1)
    if transposed:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * norm_scale + eps)
    for a, b, c in coefficients[:steps]:
        A = gram(x)
        x = a * x + (b * A + c * gram(A)) @ x  # A A = A A^T: A is symmetric
    if transposed:
        x = x.mT
    return x.to(update.dtype)


def row_normalize(update):
    """MuonEq-R ([X] code): every row of each (out, in) matrix scaled to unit norm."""
    return update / update.float().norm(dim=-1, keepdim=True).clamp_min(1e-7).to(update.dtype)


def second_moment_shape(shape):
    """The [X] variant's second-moment buffer: one value per row of a tall or square (..., rows, cols)
    matrix, per column of a wide one."""
    return (*shape[:-1], 1) if shape[-2] >= shape[-1] else (*shape[:-2], 1, shape[-1])


def variance_reduction(direction, second_moment, beta2, shape, reduce=None):
    """[X] code: the orthogonalised update's mean square per row (tall, square) or column (wide) goes into
    the EMA second_moment (in place); each row / column is scaled by its rsqrt, then the whole matrix back
    to the Frobenius norm it had. shape: the matrix's global (..., rows, cols). reduce: for a matrix whose
    rows are split across ranks (FSDP2), the sum over ranks (else None)."""
    g, rows, cols = direction.float(), shape[-2], shape[-1]
    if rows >= cols:  # per row: this rank's rows are whole
        v_mean = g.square().mean(dim=-1, keepdim=True)
    else:  # per column: a sum over every row
        v_mean = g.square().sum(dim=-2, keepdim=True)
        v_mean = (reduce(v_mean) if reduce else v_mean) / rows
    size = cols if rows >= cols else rows
    second_moment.lerp_(v_mean.to(second_moment.dtype), 1 - beta2)
    step = second_moment.float().clamp_min(1e-10).rsqrt()
    sums = torch.stack([v_mean.sum(dim=(-2, -1)) * size, (v_mean * size * step.square()).sum(dim=(-2, -1))])
    if reduce and rows >= cols:  # the norms of a matrix split by rows
        sums = reduce(sums)
    v_norm, v_norm_new = sums.sqrt()
    return (g * step * (v_norm / v_norm_new.clamp_min(1e-10))[..., None, None]).to(direction.dtype)


def muon_lr_scale(shape):
    """max(1, rows/cols)^0.5 of the (out, in) matrix (per expert for (E, out, in))."""
    return max(1.0, shape[-2] / shape[-1]) ** 0.5


def newton_schulz_cost(shape):
    """Multiply-adds of one Newton-Schulz step on a (..., m, n) tensor: 2 s^2 l + s^3 per matrix, with
    s, l the short and long side."""
    short, long = sorted(shape[-2:])
    return shape[:-2].numel() * (2 * short * short * long + short ** 3)


# The two variants. Each updates one matrix, top to bottom: p, grad and state (its buffers) are this rank's
# tensors (the local shard under FSDP2), shape the matrix's whole (..., rows, cols), reduce the sum over the
# ranks its rows are split across (else None). `yield` hands Muon.step the direction and takes it back
# orthogonalised: step orthogonalises every matrix's direction together (batched, or FSDP2: on its owner).


def original_update(p, grad, state, group, shape, reduce=None):
    """Keller Jordan's Muon (KellerJordan/Muon, muon_update)."""
    buf, m, lr = state["momentum_buffer"], group["momentum"], group["lr"]
    buf.mul_(m).add_(grad)  # momentum
    direction = grad.add(buf, alpha=m) if group["nesterov"] else buf  # Nesterov
    update = yield direction  # orthogonalised: NS_COEFFICIENTS, X / (||X|| + 1e-7)
    if group["weight_decay"]:
        p.mul_(1 - lr * group["weight_decay"])  # decoupled weight decay
    p.add_(update.to(p.dtype), alpha=-lr * muon_lr_scale(shape))


def x_update(p, grad, state, group, shape, reduce=None):
    """The [X] paper code's Muon (qlabs-eng/scaling-exponents, models/optimizer.py, muon_step_fused)."""
    buf, m, lr = state["momentum_buffer"], group["momentum"], group["lr"] * muon_lr_scale(shape)
    buf.lerp_(grad, 1 - m)  # momentum as an EMA
    direction = grad.lerp(buf, m) if group["nesterov"] else buf.clone()  # Nesterov
    update = yield row_normalize(direction)  # MuonEq-R; orthogonalised: POLAR_EXPRESS, X / (1.02 ||X|| + 1e-6)
    update = variance_reduction(update, state["second_momentum_buffer"], group["beta2"], shape, reduce).to(p.dtype)
    p.sub_(lr * update + lr * group["weight_decay"] * p * (update * p >= 0))  # cautious weight decay, scaled lr


class Variant(NamedTuple):
    update: Callable  # one matrix's update, above
    orthogonalize: dict  # orthogonalize's coefficients, norm_scale and eps
    batched: bool  # the directions of one shape orthogonalised in one call ([X] code), else one by one
    second_moment: bool  # variance reduction: a second-moment buffer in the state


VARIANTS = {"original": Variant(original_update, {}, batched=False, second_moment=False),
            "x": Variant(x_update, dict(coefficients=POLAR_EXPRESS, norm_scale=1.02, eps=1e-6),
                         batched=True, second_moment=True)}


# FSDP2 helpers: which parameters are split across ranks, and their local shards


def is_dtensor(x):
    """Whether x is a DTensor. A DTensor exists only once torch.distributed.tensor is imported: asking
    sys.modules spares runs without one the import (0.6 s of CPU)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def local(x):
    """The local shard of a DTensor (a view: in-place ops on it update the DTensor); a plain tensor as is."""
    return x.to_local() if is_dtensor(x) else x


def split_dim(p):
    """The dim along which p's (out, in) matrices are split across ranks, or None when this rank holds
    whole matrices: a plain tensor, or stacked experts (E, out, in) sharded on E."""
    if not is_dtensor(p):
        return None
    if p.device_mesh.ndim != 1 or not p.placements[0].is_shard():
        raise NotImplementedError(f"Muon: DTensors sharded on a 1-D mesh only (FSDP2), not {p.placements}")
    dim = p.placements[0].dim
    return dim if dim >= p.ndim - 2 else None


def all_reduce_sum(t, group):
    """t summed over the ranks of a process group (a new tensor)."""
    t = t.contiguous()
    dist.all_reduce(t, group=group)
    return t


def second_moment_zeros(p):
    """The variance reduction's second moment of p, zero: one value per row (tall, square) or column (wide),
    under FSDP2 sharded like p's rows, or whole on every rank (replicated) for the columns of a matrix whose
    rows are split. Made from this rank's piece: no collective."""
    shape = second_moment_shape(p.shape)
    if not is_dtensor(p):
        return torch.zeros(shape, dtype=p.dtype, device=p.device)
    from torch.distributed.tensor import DTensor, Replicate
    wide_split = split_dim(p) is not None and p.shape[-2] < p.shape[-1]
    piece = shape if wide_split else (local(p).shape[0], *shape[1:])  # FSDP2 shards dim 0
    zeros = torch.zeros(piece, dtype=p.dtype, device=local(p).device)
    return DTensor.from_local(zeros, p.device_mesh, [Replicate()] if wide_split else p.placements, run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


def pad(x, dim, size):
    """x zero-padded along dim to `size`, contiguous (collectives need equal, contiguous pieces)."""
    missing = size - x.size(dim)
    if missing == 0:
        return x.contiguous()
    return torch.cat([x, x.new_zeros(x.shape[:dim] + (missing,) + x.shape[dim + 1:])], dim)


class Muon(torch.optim.Optimizer):
    """Muon for 2-D (out, in) and stacked 3-D (E, out, in) parameters, plain tensors or FSDP2 DTensors.
    See the module docstring.
    variant: "original" or "x" (the [X] paper code's: beta2 is its variance reduction's EMA).
    ns_dtype: the Newton-Schulz arithmetic dtype (None: bf16 on CUDA, fp32 on CPU).
    gram (attribute, not an argument): the Gram product x -> x @ x.mT of the Newton-Schulz iteration;
    None -> the plain matmul. kernels.apply(model, ..., [opt]) sets it to the half-tile Triton kernel."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0,
                 ns_dtype=None, variant="original", beta2=0.95):
        if variant not in VARIANTS:
            raise ValueError(f"Muon variant={variant!r}: must be 'original' or 'x'")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      weight_decay=weight_decay, beta2=beta2))
        self.ns_dtype, self.variant = ns_dtype, variant
        self.gram = None

    def orthogonalize(self, update, steps):
        """update orthogonalised as the variant does (its coefficients, norm scale and eps)."""
        settings = VARIANTS[self.variant].orthogonalize
        return orthogonalize(update, steps, dtype=self.ns_dtype, gram=self.gram, **settings)

    def empty_state(self, p):
        """p's state before its first step, with the shapes and shards a sharded checkpoint loads into:
        the momentum (like p), and for variance reduction its second moment (second_moment_zeros)."""
        state = {"momentum_buffer": torch.zeros_like(p)}
        if VARIANTS[self.variant].second_moment:
            state["second_momentum_buffer"] = second_moment_zeros(p)
        return state

    @torch.no_grad()
    def step(self, closure=None):  # closure: unused, in the signature that torch.distributed.checkpoint calls
        """Each matrix's update runs to its yield on this rank's shards, every direction is orthogonalised
        (orthogonalize_whole, orthogonalize_split), and each update runs on to its end with its result."""
        split, whole = [], []  # (p, group, direction, its update): matrices split across ranks / whole here
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if "momentum_buffer" not in self.state[p]:  # on every rank, also one holding no piece of p
                    self.state[p].update(self.empty_state(p))
                state = {name: local(buffer) for name, buffer in self.state[p].items()}
                split_here = split_dim(p) is not None
                reduce = functools.partial(all_reduce_sum, group=p.device_mesh.get_group()) if split_here else None
                update = VARIANTS[self.variant].update(local(p), local(p.grad), state, group, p.shape, reduce)
                direction = next(update)
                if split_here:
                    split.append((p, group, direction, update))
                elif direction.numel():  # whole matrices here (none if E < world left this rank no expert)
                    whole.append((p, group, direction, update))
        for matrices, orthogonalize_all in ((whole, self.orthogonalize_whole), (split, self.orthogonalize_split)):
            for (*_, update), result in zip(matrices, orthogonalize_all(matrices)):
                with contextlib.suppress(StopIteration):  # the update runs to its end
                    update.send(result)

    def orthogonalize_whole(self, whole):
        """The directions of the matrices whole on this rank, orthogonalised: one by one, or for a batched
        variant (the [X] code) those of one shape and step count stacked into one call."""
        if not VARIANTS[self.variant].batched:
            return [self.orthogonalize(direction, group["ns_steps"]) for _, group, direction, _ in whole]
        out, buckets = [None] * len(whole), {}
        for i, (_, group, direction, _) in enumerate(whole):
            buckets.setdefault((direction.shape, direction.dtype, group["ns_steps"]), []).append(i)
        for (_, _, steps), members in buckets.items():
            stacked = self.orthogonalize(torch.stack([whole[i][2] for i in members]), steps)
            for i, result in zip(members, stacked):
                out[i] = result
        return out

    # FSDP2: matrices split across ranks are orthogonalised whole, each on one owner rank

    def split_matrices(self):
        """The parameters whose matrices are split across ranks (FSDP2 shards of (out, in) weights), in
        parameter-group order."""
        return [p for group in self.param_groups for p in group["params"] if split_dim(p) is not None]

    def owners(self):
        """owners()[i]: the rank (in its mesh) that orthogonalises split_matrices()[i]. The largest
        Newton-Schulz work first, each to the least-loaded rank so far, so the work spreads evenly. It
        depends on shapes only: every rank computes the same owners without communicating."""
        matrices = self.split_matrices()
        owners, work = [None] * len(matrices), {}  # work[mesh][rank]: Newton-Schulz work assigned so far
        for i in sorted(range(len(matrices)), key=lambda i: -newton_schulz_cost(matrices[i].shape)):
            mesh = matrices[i].device_mesh
            load = work.setdefault(mesh, [0] * mesh.size())
            owners[i] = load.index(min(load))
            load[owners[i]] += newton_schulz_cost(matrices[i].shape)
        return owners

    def orthogonalize_split(self, split):
        """This rank's shard of the orthogonalised direction of each (p, group, local direction, _) in `split`.
        Every rank sends its shard to the matrix's owner (gather), the owner orthogonalises the whole
        matrix and sends every rank its shard back (scatter). FSDP2 shards like torch.chunk: ceil(rows /
        world) rows per rank, the last ranks may hold fewer or none, so shards are zero-padded to that
        size. They travel in the Newton-Schulz dtype: orthogonalize casts to it first anyway, so bf16 on
        CUDA halves the bytes and changes no number. All gathers are in flight together, then all
        scatters."""
        owner_of = dict(zip(self.split_matrices(), self.owners()))
        shards, pieces, handles = [], [], []  # pieces: the gathered shards, on the owner only
        for p, group, direction, _ in split:
            mesh, dim = p.device_mesh, split_dim(p)
            rows = -(-p.shape[dim] // mesh.size())  # ceil(rows / world): a full shard (along dim)
            shard = pad(direction.to(self.ns_dtype or newton_schulz_dtype(direction)), dim, rows)
            owned = mesh.get_local_rank() == owner_of[p]
            shards.append(shard)
            pieces.append([torch.empty_like(shard) for _ in range(mesh.size())] if owned else None)
            handles.append(dist.gather(shard, pieces[-1], group=mesh.get_group(), group_dst=owner_of[p],
                                       async_op=True))
        for handle in handles:
            handle.wait()
        results, handles = [], []
        for (p, group, direction, _), shard, gathered in zip(split, shards, pieces):
            mesh, dim = p.device_mesh, split_dim(p)
            if gathered is not None:  # this rank owns p: orthogonalise the whole matrix, cut it into shards
                whole = torch.cat(gathered, dim).narrow(dim, 0, p.shape[dim])  # without the padding
                whole = pad(self.orthogonalize(whole, group["ns_steps"]), dim, mesh.size() * shard.size(dim))
                gathered = [piece.contiguous() for piece in whole.chunk(mesh.size(), dim)]
            result = torch.empty_like(shard)
            handles.append(dist.scatter(result, gathered, group=mesh.get_group(), group_src=owner_of[p],
                                        async_op=True))
            results.append(result.narrow(dim, 0, direction.size(dim)))  # without the padding
        for handle in handles:
            handle.wait()
        return results
