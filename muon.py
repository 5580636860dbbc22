"""
Muon: MomentUm Orthogonalized by Newton-Schulz (Keller Jordan; modded-nanogpt, nanochat) for the hidden
matrices of a transformer. Imports only torch: copy it into any project.

    opt = Muon(matrices, lr=0.02, momentum=0.95)    # 2-D (out, in) or stacked (E, ..., out, in)
    opt = Muon(matrices, lr=0.04, variant="x", weight_decay=0.07)   # the [X] paper code's Muon

Two variants, each one function (original_update, x_update). Stacked matrices are orthogonalised one by one;
`opt.gram` (None: x @ x.mT) is the iteration's Gram product, which kernels.apply sets to a Triton kernel.
FSDP2: parameters may be DTensors sharded on dim 0 of a 1-D mesh, or of the shard dim of a 2-D (replicate,
shard) mesh (HSDP: each replica group steps alike). Momentum is elementwise and stays sharded; each
(out, in) matrix split across ranks is orthogonalised whole by one owner rank (owners), which gathers the
shards and scatters the result; experts sharded on E are whole where they are. DDP: plain tensors under a
process group of several ranks are taken as replicas, each orthogonalised by its owner, which broadcasts it.
"""

import contextlib
import functools
import sys

import torch
import torch.distributed as dist

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (a, b, c): maximal slope at 0
POLAR_EXPRESS = (  # the [X] code's 5 steps, each its own (a, b, c) (Polar Express, Amsel et al. 2025)
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def newton_schulz_dtype(update):  # bf16 on CUDA as the references; fp32 on CPU (no fast bf16)
    return torch.bfloat16 if update.is_cuda else torch.float32


def orthogonalize(update, steps=5, eps=1e-7, dtype=None, gram=None, coefficients=None, norm_scale=1.0):
    """X = G / (norm_scale ||G||_F + eps), then `steps` times X <- a X + (b A + c A^2) X with A = X X^T:
    U S V^T -> U p(S) V^T with p(S) in ~[0.7, 1.2]. Batched over leading dims (experts). dtype: the
    arithmetic (None: newton_schulz_dtype); gram: x -> x @ x.mT; coefficients: one (a, b, c) per step."""
    coefficients = coefficients or [NS_COEFFICIENTS] * steps
    gram = gram or (lambda x: x @ x.mT)
    x = update.to(dtype or newton_schulz_dtype(update))
    transposed = x.size(-2) > x.size(-1)
    if transposed:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * norm_scale + eps)
    for a, b, c in coefficients[:steps]:
        A = gram(x)
        x = a * x + (b * A + c * gram(A)) @ x  # A A = A A^T: A is symmetric
    return (x.mT if transposed else x).to(update.dtype)


def row_normalize(update):
    """MuonEq-R ([X] code): every row scaled to unit norm."""
    return update / update.float().norm(dim=-1, keepdim=True).clamp_min(1e-7).to(update.dtype)


def second_moment_shape(shape):
    """One value per row of a tall or square (..., rows, cols) matrix, per column of a wide one."""
    return (*shape[:-1], 1) if shape[-2] >= shape[-1] else (*shape[:-2], 1, shape[-1])


def variance_reduction(direction, second_moment, beta2, shape, reduce=None):
    """[X] code: the mean square per row (tall) or column (wide) goes into the EMA second_moment; each
    row / column is scaled by its rsqrt, then the matrix back to its Frobenius norm. shape: the whole
    matrix's; reduce: the sum over the ranks its rows are split across (FSDP2), else None."""
    g, rows, cols = direction.float(), shape[-2], shape[-1]
    if rows >= cols:
        v_mean = g.square().mean(dim=-1, keepdim=True)
    else:  # a column sums over every row
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
    return max(1.0, shape[-2] / shape[-1]) ** 0.5  # max(1, rows/cols)^0.5, per expert for (E, out, in)


# The variants: one matrix's update on this rank's tensors (shape: the whole matrix's); `yield` hands
# Muon.step the direction and takes it back orthogonalised.


def original_update(p, grad, state, group, shape, reduce=None):
    """Keller Jordan's Muon (KellerJordan/Muon, muon_update): Nesterov momentum, NS_COEFFICIENTS 5 steps."""
    buf, m, lr = state["momentum_buffer"], group["momentum"], group["lr"]
    buf.mul_(m).add_(grad)
    direction = grad.add(buf, alpha=m) if group["nesterov"] else buf
    update = yield direction
    if group["weight_decay"]:
        p.mul_(1 - lr * group["weight_decay"])  # decoupled weight decay
    p.add_(update.to(p.dtype), alpha=-lr * muon_lr_scale(shape))


def x_update(p, grad, state, group, shape, reduce=None):
    """The [X] code's Muon (qlabs-eng/scaling-exponents, models/optimizer.py, muon_step_fused): EMA
    momentum, MuonEq-R, POLAR_EXPRESS, variance reduction, cautious weight decay, batched by shape."""
    buf, m, lr = state["momentum_buffer"], group["momentum"], group["lr"] * muon_lr_scale(shape)
    buf.lerp_(grad, 1 - m)  # momentum as an EMA
    direction = grad.lerp(buf, m) if group["nesterov"] else buf.clone()
    update = yield row_normalize(direction)  # MuonEq-R
    update = variance_reduction(update, state["second_momentum_buffer"], group["beta2"], shape, reduce)
    update = update.to(p.dtype)
    p.sub_(lr * update + lr * group["weight_decay"] * p * (update * p >= 0))  # cautious weight decay


VARIANTS = {  # update, orthogonalize's settings, one batched call per shape, a second moment
    "original": dict(update=original_update, ns={}, batched=False, second_moment=False),
    "x": dict(update=x_update, ns=dict(coefficients=POLAR_EXPRESS, norm_scale=1.02, eps=1e-6), batched=True,
              second_moment=True)}


def is_dtensor(x):  # without importing torch.distributed.tensor when nothing made one
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def local(x):
    return x.to_local() if is_dtensor(x) else x  # a view: in-place ops update the DTensor


def sharding(p):
    """(the 1-D mesh a DTensor p is sharded over, the dim it is cut along): FSDP2's mesh, or the shard dim
    of HSDP's 2-D (replicate, shard) mesh."""
    cut = [i for i, placement in enumerate(p.placements) if placement.is_shard()]
    if len(cut) != 1 or not all(pl.is_shard() or pl.is_replicate() for pl in p.placements):
        raise NotImplementedError(f"Muon: DTensors sharded along one mesh dim only (FSDP2, HSDP), not "
                                  f"{p.placements}")
    mesh = p.device_mesh if p.device_mesh.ndim == 1 else p.device_mesh[p.device_mesh.mesh_dim_names[cut[0]]]
    return mesh, p.placements[cut[0]].dim


def split_dim(p):
    """The dim along which p's (out, in) matrices are split across ranks; None when this rank holds whole
    matrices (a plain tensor, or stacked experts sharded on E)."""
    if not is_dtensor(p):
        return None
    dim = sharding(p)[1]
    return dim if dim >= p.ndim - 2 else None


def all_reduce_sum(t, group):
    dist.all_reduce(t := t.contiguous(), group=group)
    return t


def second_moment_zeros(p):
    """Zero second moment of p: sharded like p's rows, or replicated for the columns of a wide matrix whose
    rows are split. Made from this rank's piece: no collective."""
    shape = second_moment_shape(p.shape)
    if not is_dtensor(p):
        return torch.zeros(shape, dtype=p.dtype, device=p.device)
    from torch.distributed.tensor import DTensor, Replicate
    wide_split = split_dim(p) is not None and p.shape[-2] < p.shape[-1]
    piece = shape if wide_split else (local(p).shape[0], *shape[1:])
    zeros = torch.zeros(piece, dtype=p.dtype, device=local(p).device)
    placements = [Replicate()] * p.device_mesh.ndim if wide_split else p.placements
    return DTensor.from_local(zeros, p.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def pad(x, dim, size):
    """x zero-padded along dim to `size`, contiguous (collectives need equal pieces)."""
    missing = size - x.size(dim)
    if missing == 0:
        return x.contiguous()
    return torch.cat([x, x.new_zeros(*x.shape[:dim], missing, *x.shape[dim + 1:])], dim)


class Muon(torch.optim.Optimizer):
    """variant: "original" or "x" (beta2: its variance reduction's EMA). ns_dtype: the Newton-Schulz dtype
    (None: bf16 on CUDA, fp32 on CPU). Attribute gram: the Gram product (None: x @ x.mT)."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0,
                 ns_dtype=None, variant="original", beta2=0.95):
        if variant not in VARIANTS:
            raise ValueError(f"Muon variant={variant!r}: must be 'original' or 'x'")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      weight_decay=weight_decay, beta2=beta2))
        self.ns_dtype, self.variant, self.gram = ns_dtype, variant, None

    def orthogonalize(self, update, steps):
        settings = VARIANTS[self.variant]["ns"]
        return orthogonalize(update, steps, dtype=self.ns_dtype, gram=self.gram, **settings)

    def empty_state(self, p):
        """p's state before its first step, shaped as a sharded checkpoint loads it."""
        state = {"momentum_buffer": torch.zeros_like(p)}
        if VARIANTS[self.variant]["second_moment"]:
            state["second_momentum_buffer"] = second_moment_zeros(p)
        return state

    @torch.no_grad()
    def step(self, closure=None):  # closure: unused (torch.distributed.checkpoint passes one)
        """Each update runs to its yield, every direction is orthogonalised, each update runs to its end."""
        split, replicas, whole = [], [], []  # (p, group, direction, its update)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p] = self.state[p] or self.empty_state(p)
                state = {name: local(buffer) for name, buffer in self.state[p].items()}
                split_here = split_dim(p) is not None
                reduce = split_here and functools.partial(all_reduce_sum, group=sharding(p)[0].get_group())
                update = VARIANTS[self.variant]["update"](local(p), local(p.grad), state, group, p.shape,
                                                          reduce)
                direction = next(update)
                if split_here:
                    split.append((p, group, direction, update))
                elif p in self.owners:
                    replicas.append((p, group, direction, update))
                elif direction.numel():  # (a rank may hold no expert of a small E)
                    whole.append((p, group, direction, update))
        results = self.orthogonalize_whole(whole) + self.orthogonalize_split(split)
        results += self.orthogonalize_replicas(replicas)
        for (*_, update), result in zip(whole + split + replicas, results):
            with contextlib.suppress(StopIteration):  # the update runs to its end
                update.send(result)

    def orthogonalize_whole(self, whole):
        """One by one, or for a batched variant those of one shape and step count stacked in one call."""
        if not VARIANTS[self.variant]["batched"]:
            return [self.orthogonalize(direction, group["ns_steps"]) for _, group, direction, _ in whole]
        out, buckets = {}, {}
        for i, (_, group, direction, _) in enumerate(whole):
            buckets.setdefault((direction.shape, direction.dtype, group["ns_steps"]), []).append(i)
        for (_, _, steps), members in buckets.items():
            out.update(zip(members, self.orthogonalize(torch.stack([whole[i][2] for i in members]), steps)))
        return [out[i] for i in range(len(whole))]

    @functools.cached_property
    def owners(self):
        """{matrix split across ranks, or DDP replica (a plain tensor, several ranks): the rank that
        orthogonalises it}. Largest Newton-Schulz work first, each to its group's least-loaded rank: from
        shapes only, so every rank computes the same owners."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        shared = [p for g in self.param_groups for p in g["params"] if split_dim(p) is not None or
                  world > 1 and not is_dtensor(p)]
        owners, work = {}, {}
        for p in sorted(shared, key=lambda p: -newton_schulz_cost(p.shape)):
            ranks = sharding(p)[0].get_group() if is_dtensor(p) else dist.group.WORLD
            load = work.setdefault(ranks, [0] * dist.get_world_size(ranks))
            owners[p] = load.index(min(load))
            load[owners[p]] += newton_schulz_cost(p.shape)
        return owners

    def orthogonalize_replicas(self, replicas):
        """Each rank orthogonalises the DDP replicas it owns (batched as orthogonalize_whole batches) and
        broadcasts them in the Newton-Schulz dtype (exact: computed in it). All in flight, then waited on."""
        mine = [entry for entry in replicas if self.owners[entry[0]] == dist.get_rank()]
        done = dict(zip([p for p, *_ in mine], self.orthogonalize_whole(mine)))
        out = [torch.empty_like(d, dtype=self.ns_dtype or newton_schulz_dtype(d)) for _, _, d, _ in replicas]
        handles = [dist.broadcast(o.copy_(done[p]) if p in done else o, self.owners[p], async_op=True)
                   for o, (p, *_) in zip(out, replicas)]
        for handle in handles:
            handle.wait()
        return [o.to(d.dtype) for o, (_, _, d, _) in zip(out, replicas)]

    def orthogonalize_split(self, split):
        """This rank's shard of each split matrix's orthogonalised direction: every rank gathers its shard
        (padded to ceil(rows / world), as torch.chunk cuts; in the Newton-Schulz dtype) to the owner, which
        orthogonalises the whole matrix and scatters it back. All gathers in flight, then all scatters."""
        shards, pieces, handles = [], [], []
        for p, group, direction, _ in split:
            (mesh, dim), owner = sharding(p), self.owners[p]
            shard = pad(direction.to(self.ns_dtype or newton_schulz_dtype(direction)), dim,
                        -(-p.shape[dim] // mesh.size()))
            shards.append(shard)
            pieces.append([torch.empty_like(shard) for _ in range(mesh.size())]
                          if mesh.get_local_rank() == owner else None)
            handles.append(dist.gather(shard, pieces[-1], group=mesh.get_group(), group_dst=owner,
                                       async_op=True))
        for handle in handles:
            handle.wait()
        results, handles = [], []
        for (p, group, direction, _), shard, gathered in zip(split, shards, pieces):
            (mesh, dim), owner = sharding(p), self.owners[p]
            if gathered is not None:  # the owner: the whole matrix, without the padding, then cut again
                whole = torch.cat(gathered, dim).narrow(dim, 0, p.shape[dim])
                whole = pad(self.orthogonalize(whole, group["ns_steps"]), dim, mesh.size() * shard.size(dim))
                gathered = [piece.contiguous() for piece in whole.chunk(mesh.size(), dim)]
            result = torch.empty_like(shard)
            handles.append(dist.scatter(result, gathered, group=mesh.get_group(), group_src=owner,
                                        async_op=True))
            results.append(result.narrow(dim, 0, direction.size(dim)))
        for handle in handles:
            handle.wait()
        return [result.to(direction.dtype) for result, (_, _, direction, _) in zip(results, split)]


def newton_schulz_cost(shape):
    """Multiply-adds of one Newton-Schulz step on (..., m, n): 2 s^2 l + s^3 per matrix."""
    short, long = sorted(shape[-2:])
    return shape[:-2].numel() * (2 * short * short * long + short ** 3)
