"""
Muon: MomentUm Orthogonalized by Newton-Schulz (Keller Jordan; modded-nanogpt, nanochat),
for a transformer's hidden matrices. It imports only torch.

    opt = Muon(matrices, lr=0.02, momentum=0.95)  # (out, in) or stacked (E, ..., out, in)
    opt = Muon(matrices, lr=0.04, variant="x", weight_decay=0.07)  # the [X] code's Muon

The file down to the "distributed" divider is Muon in one process: copy it alone.
Below it, Muon learns FSDP2's sharded parameters and DDP's replicas.
"""

import torch

# Keller Jordan's quintic (a, b, c): the steepest slope at 0.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# The [X] code's five steps, each its own (a, b, c): Polar Express (Amsel et al. 2025).
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def newton_schulz_dtype(update):
    # bf16 on CUDA, as the references run it; a CPU has no fast bf16.
    return torch.bfloat16 if update.is_cuda else torch.float32


def orthogonalize(
    update, steps=5, eps=1e-7, dtype=None, gram=None, coefficients=None, norm_scale=1.0
):
    """U S V^T -> U p(S) V^T with p(S) in ~[0.7, 1.2], batched over leading dims.
    gram: x @ x.mT or a kernel; coefficients: one (a, b, c) per step."""
    coefficients = coefficients or [NS_COEFFICIENTS] * steps
    gram = gram or (lambda x: x @ x.mT)
    x = update.to(dtype or newton_schulz_dtype(update))
    # Iterate on the smaller of the two Gram matrices.
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * norm_scale + eps)
    # Each step: X <- a X + (b A + c A^2) X with A = X X^T.
    for a, b, c in coefficients[:steps]:
        A = gram(x)
        # A is symmetric, so A A = A A^T is a Gram product too.
        x = a * x + (b * A + c * gram(A)) @ x
    return (x.mT if transposed else x).to(update.dtype)


def row_normalize(update):
    """MuonEq-R ([X] code): every row scaled to unit norm."""
    norm = update.float().norm(dim=-1, keepdim=True).clamp_min(1e-7)
    return update / norm.to(update.dtype)


# One value per row of a tall or square matrix, one per column of a wide one.
def second_moment_shape(shape):
    if shape[-2] >= shape[-1]:
        return (*shape[:-1], 1)
    return (*shape[:-2], 1, shape[-1])


def variance_reduction(direction, second_moment, beta2, shape, reduce=None):
    """[X] code: each row (tall) or column (wide) times the rsqrt of its mean square's
    EMA, then the matrix back to its norm. reduce: the sum over ranks (FSDP2) or None."""
    g, rows, cols = direction.float(), shape[-2], shape[-1]
    if rows >= cols:
        v_mean = g.square().mean(dim=-1, keepdim=True)
    else:
        # A column's mean runs over every row, some of them on other ranks.
        v_mean = g.square().sum(dim=-2, keepdim=True)
        v_mean = (reduce(v_mean) if reduce else v_mean) / rows
    size = cols if rows >= cols else rows
    second_moment.lerp_(v_mean.to(second_moment.dtype), 1 - beta2)
    step = second_moment.float().clamp_min(1e-10).rsqrt()
    sums = torch.stack([
        v_mean.sum(dim=(-2, -1)) * size,
        (v_mean * size * step.square()).sum(dim=(-2, -1)),
    ])
    # The two norms of a matrix split by rows sum over its ranks.
    if reduce and rows >= cols:
        sums = reduce(sums)
    v_norm, v_norm_new = sums.sqrt()
    scale = (v_norm / v_norm_new.clamp_min(1e-10))[..., None, None]
    return (g * step * scale).to(direction.dtype)


def muon_lr_scale(shape):
    # max(1, rows / cols)^0.5, per expert for (E, out, in).
    return max(1.0, shape[-2] / shape[-1]) ** 0.5


# The variants: one matrix's update. It yields the direction to Muon.step, which sends
# it back orthogonalised. shape is the whole matrix's.


def original_update(p, grad, state, group, shape, reduce=None):
    """Keller Jordan's Muon (KellerJordan/Muon, muon_update)."""
    buf, m, lr = state["momentum_buffer"], group["momentum"], group["lr"]
    buf.mul_(m).add_(grad)
    direction = grad.add(buf, alpha=m) if group["nesterov"] else buf
    update = yield direction
    if group["weight_decay"]:
        # Decoupled weight decay.
        p.mul_(1 - lr * group["weight_decay"])
    p.add_(update.to(p.dtype), alpha=-lr * muon_lr_scale(shape))


def x_update(p, grad, state, group, shape, reduce=None):
    """The [X] code's Muon (qlabs-eng/scaling-exponents, models/optimizer.py)."""
    buf, m = state["momentum_buffer"], group["momentum"]
    lr = group["lr"] * muon_lr_scale(shape)
    # The momentum is an EMA.
    buf.lerp_(grad, 1 - m)
    direction = grad.lerp(buf, m) if group["nesterov"] else buf.clone()
    # MuonEq-R, then POLAR_EXPRESS in Muon.step.
    update = yield row_normalize(direction)
    update = variance_reduction(
        update, state["second_momentum_buffer"], group["beta2"], shape, reduce
    )
    update = update.to(p.dtype)
    # Cautious weight decay: only where the update and the weight share a sign.
    p.sub_(lr * update + lr * group["weight_decay"] * p * (update * p >= 0))


# Per variant: its update, orthogonalize's settings, one batched call per shape or
# not, a second moment or not.
VARIANTS = {
    "original": dict(update=original_update, ns={}, batched=False, second_moment=False),
    "x": dict(
        update=x_update,
        ns=dict(coefficients=POLAR_EXPRESS, norm_scale=1.02, eps=1e-6),
        batched=True,
        second_moment=True,
    ),
}


class Muon(torch.optim.Optimizer):
    """variant: "original" or "x" (beta2: its second moment's EMA). ns_dtype: None for
    newton_schulz_dtype. gram: see orthogonalize."""

    def __init__(
        self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0,
        ns_dtype=None, variant="original", beta2=0.95,
    ):
        if variant not in VARIANTS:
            raise ValueError(f"Muon variant={variant!r}: must be 'original' or 'x'")
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
            weight_decay=weight_decay, beta2=beta2,
        )
        super().__init__(params, defaults)
        self.ns_dtype, self.variant, self.gram = ns_dtype, variant, None

    def orthogonalize(self, update, steps):
        settings = VARIANTS[self.variant]["ns"]
        return orthogonalize(update, steps, dtype=self.ns_dtype, gram=self.gram, **settings)

    def empty_state(self, p):
        state = {"momentum_buffer": torch.zeros_like(p)}
        if VARIANTS[self.variant]["second_moment"]:
            shape = second_moment_shape(p.shape)
            state["second_momentum_buffer"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
        return state

    # The closure is unused; torch.distributed.checkpoint passes one.
    @torch.no_grad()
    def step(self, closure=None):
        # Each update runs to its yield, all directions are orthogonalised, each
        # update runs to its end.
        started = [
            self.start(p, group)
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        for (*_, update), result in zip(started, self.orthogonalize_all(started)):
            try:
                update.send(result)
            except StopIteration:
                pass

    def start(self, p, group):
        """(p, group, direction, p's update paused at its yield)."""
        self.state[p] = self.state[p] or self.empty_state(p)
        update = VARIANTS[self.variant]["update"](p, p.grad, self.state[p], group, p.shape)
        return p, group, next(update), update

    def orthogonalize_all(self, started):
        # One by one, or for a batched variant one call per shape and step count.
        if not VARIANTS[self.variant]["batched"]:
            return [self.orthogonalize(d, group["ns_steps"]) for _, group, d, _ in started]
        out, buckets = {}, {}
        for i, (_, group, d, _) in enumerate(started):
            buckets.setdefault((d.shape, d.dtype, group["ns_steps"]), []).append(i)
        for (_, _, steps), members in buckets.items():
            stacked = torch.stack([started[i][2] for i in members])
            out.update(zip(members, self.orthogonalize(stacked, steps)))
        return [out[i] for i in range(len(started))]


# --- distributed: FSDP2 and DDP. Nothing above needs what follows. --------------------
#
# FSDP2: parameters may be DTensors sharded on dim 0 of a 1-D mesh, or on the shard dim
# of HSDP's 2-D (replicate, shard) mesh. The momentum stays sharded. One owner rank
# gathers each (out, in) matrix split across ranks, orthogonalises it whole and scatters
# the result. Experts sharded on E are whole where they are.
# DDP: plain tensors under several ranks are replicas; each owner broadcasts its own.

import functools  # noqa: E402
import sys  # noqa: E402

import torch.distributed as dist  # noqa: E402


def is_dtensor(x):
    # Without importing torch.distributed.tensor when nothing made a DTensor.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def local(x):
    # A view: in-place ops on it update the DTensor.
    return x.to_local() if is_dtensor(x) else x


# (the 1-D mesh a DTensor p is sharded over, the dim it is cut along).
def sharding(p):
    cut = [i for i, placement in enumerate(p.placements) if placement.is_shard()]
    if len(cut) != 1 or not all(pl.is_shard() or pl.is_replicate() for pl in p.placements):
        raise NotImplementedError(
            f"Muon: DTensors sharded along one mesh dim only (FSDP2, HSDP), not {p.placements}"
        )
    mesh = p.device_mesh
    # HSDP: the shard dim of the (replicate, shard) mesh.
    if mesh.ndim > 1:
        mesh = mesh[mesh.mesh_dim_names[cut[0]]]
    return mesh, p.placements[cut[0]].dim


# The dim p's (out, in) matrices are split along; None when they are whole here.
def split_dim(p):
    if not is_dtensor(p):
        return None
    dim = sharding(p)[1]
    return dim if dim >= p.ndim - 2 else None


def all_reduce_sum(t, group):
    dist.all_reduce(t := t.contiguous(), group=group)
    return t


# A DTensor p's zero second moment, made from this rank's piece: no collective.
def second_moment_zeros(p):
    from torch.distributed.tensor import DTensor, Replicate

    shape = second_moment_shape(p.shape)
    # Sharded like p's rows, or replicated for the columns of a wide matrix split by rows.
    wide_split = split_dim(p) is not None and p.shape[-2] < p.shape[-1]
    piece = shape if wide_split else (local(p).shape[0], *shape[1:])
    zeros = torch.zeros(piece, dtype=p.dtype, device=local(p).device)
    placements = [Replicate()] * p.device_mesh.ndim if wide_split else p.placements
    return DTensor.from_local(
        zeros, p.device_mesh, placements, run_check=False, shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )


def pad(x, dim, size):
    # Collectives need equal, contiguous pieces.
    missing = size - x.size(dim)
    if missing == 0:
        return x.contiguous()
    return torch.cat([x, x.new_zeros(*x.shape[:dim], missing, *x.shape[dim + 1:])], dim)


def newton_schulz_cost(shape):
    # Multiply-adds of one step: 2 s^2 l + s^3 per (short s, long l) matrix.
    short, long = sorted(shape[-2:])
    return shape[:-2].numel() * (2 * short * short * long + short ** 3)


class Muon(Muon):
    """The Muon above, for FSDP2's sharded parameters and DDP's replicas too."""

    def empty_state(self, p):
        # Shaped as a sharded checkpoint loads it.
        state = super().empty_state(p)
        if is_dtensor(p) and "second_momentum_buffer" in state:
            state["second_momentum_buffer"] = second_moment_zeros(p)
        return state

    def start(self, p, group):
        # The update runs on this rank's pieces.
        self.state[p] = self.state[p] or self.empty_state(p)
        state = {name: local(buffer) for name, buffer in self.state[p].items()}
        reduce = None
        if split_dim(p) is not None:
            reduce = functools.partial(all_reduce_sum, group=sharding(p)[0].get_group())
        update = VARIANTS[self.variant]["update"](
            local(p), local(p.grad), state, group, p.shape, reduce
        )
        return p, group, next(update), update

    def orthogonalize_all(self, started):
        # An empty direction (no expert of a small E here) comes back as it is.
        results = [d for _, _, d, _ in started]
        whole, split, replicas = [], [], []
        for i, (p, _, d, _) in enumerate(started):
            if split_dim(p) is not None:
                split.append(i)
            elif p in self.owners:
                replicas.append(i)
            elif d.numel():
                whole.append(i)
        for members, method in (
            (whole, super().orthogonalize_all),
            (split, self.orthogonalize_split),
            (replicas, self.orthogonalize_replicas),
        ):
            for i, result in zip(members, method([started[i] for i in members])):
                results[i] = result
        return results

    @functools.cached_property
    def owners(self):
        """{split matrix or DDP replica: the rank that orthogonalises it}."""
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        shared = [
            p
            for g in self.param_groups
            for p in g["params"]
            if split_dim(p) is not None or world > 1 and not is_dtensor(p)
        ]
        # Largest work first, each to its group's least-loaded rank. Only shapes decide,
        # so every rank computes the same owners.
        owners, work = {}, {}
        for p in sorted(shared, key=lambda p: -newton_schulz_cost(p.shape)):
            ranks = sharding(p)[0].get_group() if is_dtensor(p) else dist.group.WORLD
            load = work.setdefault(ranks, [0] * dist.get_world_size(ranks))
            owners[p] = load.index(min(load))
            load[owners[p]] += newton_schulz_cost(p.shape)
        return owners

    def orthogonalize_replicas(self, replicas):
        # Each rank orthogonalises the replicas it owns and broadcasts them in the
        # Newton-Schulz dtype (exact: computed in it), all in flight, then waited on.
        mine = [entry for entry in replicas if self.owners[entry[0]] == dist.get_rank()]
        done = dict(zip([p for p, *_ in mine], super().orthogonalize_all(mine)))
        out = [
            torch.empty_like(d, dtype=self.ns_dtype or newton_schulz_dtype(d))
            for _, _, d, _ in replicas
        ]
        handles = [
            dist.broadcast(o.copy_(done[p]) if p in done else o, self.owners[p], async_op=True)
            for o, (p, *_) in zip(out, replicas)
        ]
        for handle in handles:
            handle.wait()
        return [o.to(d.dtype) for o, (_, _, d, _) in zip(out, replicas)]

    def orthogonalize_split(self, split):
        # Each rank sends the owner its shard in the Newton-Schulz dtype, padded to
        # ceil(rows / world) as torch.chunk cuts. All gathers in flight, then all scatters.
        shards, pieces, handles = [], [], []
        for p, group, direction, _ in split:
            (mesh, dim), owner = sharding(p), self.owners[p]
            dtype = self.ns_dtype or newton_schulz_dtype(direction)
            shard = pad(direction.to(dtype), dim, -(-p.shape[dim] // mesh.size()))
            shards.append(shard)
            is_owner = mesh.get_local_rank() == owner
            empty = [torch.empty_like(shard) for _ in range(mesh.size())]
            pieces.append(empty if is_owner else None)
            handles.append(dist.gather(
                shard, pieces[-1], group=mesh.get_group(), group_dst=owner, async_op=True
            ))
        for handle in handles:
            handle.wait()
        results, handles = [], []
        for (p, group, direction, _), shard, gathered in zip(split, shards, pieces):
            (mesh, dim), owner = sharding(p), self.owners[p]
            if gathered is not None:
                # The owner: the whole matrix without the padding, orthogonalised, cut again.
                whole = torch.cat(gathered, dim).narrow(dim, 0, p.shape[dim])
                whole = self.orthogonalize(whole, group["ns_steps"])
                whole = pad(whole, dim, mesh.size() * shard.size(dim))
                gathered = [piece.contiguous() for piece in whole.chunk(mesh.size(), dim)]
            result = torch.empty_like(shard)
            handles.append(dist.scatter(
                result, gathered, group=mesh.get_group(), group_src=owner, async_op=True
            ))
            results.append(result.narrow(dim, 0, direction.size(dim)))
        for handle in handles:
            handle.wait()
        return [result.to(d.dtype) for result, (_, _, d, _) in zip(results, split)]
