"""
Muon: MomentUm Orthogonalized by Newton-Schulz (Keller Jordan; as in modded-nanogpt and nanochat), for
the hidden matrices of a transformer. One file with no project imports: copy it into any project.

    from muon import Muon
    opt = Muon(hidden_matrices, lr=0.02, momentum=0.95)      # 2-D (out, in) or stacked experts (E, out, in)

The update of each matrix is SGD momentum (Nesterov by default), orthogonalised by five steps of the
quintic Newton-Schulz iteration (orthogonalize), scaled by lr * max(1, rows/cols)^0.5 so that tall
matrices get the same RMS update per element. A stacked expert tensor (E, out, in) is orthogonalised
per expert. Decoupled weight decay p <- p (1 - lr wd). The iteration's Gram product is `opt.gram`
(None: x @ x.mT); kernels.apply(model, [opt]) sets it to a Triton kernel computing half the tiles.

FSDP2: the same class takes parameters that are DTensors sharded on a 1-D mesh (fully_shard). Momentum
is elementwise, so it runs on the local shard and its buffer stays sharded (a DTensor like the grad).
Newton-Schulz needs whole matrices: each (out, in) matrix split across ranks has one owner rank
(owners()); every rank sends the owner its shard of the update, the owner orthogonalises the whole
matrix and sends every rank its shard of the result back. Stacked experts sharded on E hold whole
experts on each rank: they are orthogonalised where they are, with no communication. The collectives
pair up across ranks, so every rank must step with grads on the same parameters (as FSDP2 gives).
The momentum buffers are DTensors: torch.distributed.checkpoint saves and loads them sharded.
Plain tensors (single process, DDP) take the same path as before, with no communication.
"""

import sys

import torch
import torch.distributed as dist

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic (a, b, c): maximal slope at 0, 5 steps suffice


def newton_schulz_dtype(update):
    """The default Newton-Schulz arithmetic dtype: bfloat16 on CUDA (as the references), float32
    elsewhere (CPUs have no fast bf16)."""
    return torch.bfloat16 if update.is_cuda else torch.float32


def orthogonalize(update, steps=5, eps=1e-7, dtype=None, gram=None):
    """Newton-Schulz quintic iteration: X <- a X + (b A + c A^2) X with A = X X^T, `steps` times, after
    X = G / ||G||_F (so every singular value starts <= 1). The coefficients maximise the slope at 0, so
    small singular values grow fast; the result is U S' V^T with S' in ~[0.7, 1.2], not exactly 1,
    which is all Muon needs. Batched over leading dims: a stacked expert tensor (E, out, in) is
    orthogonalised per expert.
    dtype: the arithmetic dtype; None -> newton_schulz_dtype (bf16 on CUDA, fp32 elsewhere). Pass
    torch.bfloat16 on CPU to rehearse the CUDA arithmetic.
    gram: x -> x @ x.mT for both Gram products of each step (A = X X^T, and A A = A A^T: A is
    symmetric); None -> the plain matmul. Muon passes its `gram` attribute (kernels.gram: a Triton
    kernel computing half the tiles)."""
    a, b, c = NS_COEFFICIENTS
    dtype = dtype or newton_schulz_dtype(update)
    gram = gram or (lambda x: x @ x.mT)
    x = update.to(dtype)
    transposed = x.size(-2) > x.size(-1)
    if transposed:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = gram(x)
        x = a * x + (b * A + c * gram(A)) @ x  # A A = A A^T: A is symmetric
    if transposed:
        x = x.mT
    return x.to(update.dtype)


def muon_lr_scale(shape):
    """max(1, rows/cols)^0.5 of the (out, in) matrix (per expert for (E, out, in))."""
    return max(1.0, shape[-2] / shape[-1]) ** 0.5


def newton_schulz_cost(shape):
    """Multiply-adds of one Newton-Schulz step on a (..., m, n) tensor: 2 s^2 l + s^3 per matrix, with
    s, l the short and long side."""
    short, long = sorted(shape[-2:])
    return shape[:-2].numel() * (2 * short * short * long + short ** 3)


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


def pad(x, dim, size):
    """x zero-padded along dim to `size`, contiguous (collectives need equal, contiguous pieces)."""
    missing = size - x.size(dim)
    if missing == 0:
        return x.contiguous()
    return torch.cat([x, x.new_zeros(x.shape[:dim] + (missing,) + x.shape[dim + 1:])], dim)


class Muon(torch.optim.Optimizer):
    """Muon for 2-D (out, in) and stacked 3-D (E, out, in) parameters, plain tensors or FSDP2 DTensors.
    See the module docstring.
    ns_dtype: the Newton-Schulz arithmetic dtype (None: bf16 on CUDA, fp32 on CPU).
    gram (attribute, not an argument): the Gram product x -> x @ x.mT of the Newton-Schulz iteration;
    None -> the plain matmul. kernels.apply(model, [opt]) sets it to the half-tile Triton kernel."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0,
                 ns_dtype=None):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      weight_decay=weight_decay))
        self.ns_dtype = ns_dtype
        self.gram = None

    def momentum_update(self, p, group):
        """The Nesterov (or plain) momentum direction of p; the buffer lives in self.state[p]. For a
        DTensor the buffer is a DTensor like p.grad (this rank holds its shard only) and the math runs on
        the local shards."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        grad, buf = local(p.grad), local(state["momentum_buffer"])
        buf.mul_(group["momentum"]).add_(grad)
        return grad.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf

    def orthogonalize(self, update, steps):
        return orthogonalize(update, steps, dtype=self.ns_dtype, gram=self.gram)

    def apply_update(self, p, group, update):
        """Decoupled weight decay and the scaled update, on this rank's shard; the lr scale uses p's
        global (out, in) shape."""
        lr, p_local = group["lr"], local(p)
        if group["weight_decay"]:
            p_local.mul_(1 - lr * group["weight_decay"])
        p_local.add_(update.to(p.dtype), alpha=-lr * muon_lr_scale(p.shape))

    @torch.no_grad()
    def step(self, closure=None):  # closure: unused, in the signature that torch.distributed.checkpoint calls
        split = []  # (p, group, local update) of the matrices split across ranks
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = self.momentum_update(p, group)
                if split_dim(p) is not None:
                    split.append((p, group, update))
                elif update.numel():  # whole matrices here (none if E < world left this rank no expert)
                    self.apply_update(p, group, self.orthogonalize(update, group["ns_steps"]))
        for (p, group, _), update in zip(split, self.orthogonalize_split(split)):
            self.apply_update(p, group, update)

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
        """This rank's shard of the orthogonalised update of each (p, group, local update) in `split`.
        Every rank sends its shard to the matrix's owner (gather), the owner orthogonalises the whole
        matrix and sends every rank its shard back (scatter). FSDP2 shards like torch.chunk: ceil(rows /
        world) rows per rank, the last ranks may hold fewer or none, so shards are zero-padded to that
        size. They travel in the Newton-Schulz dtype: orthogonalize casts to it first anyway, so bf16 on
        CUDA halves the bytes and changes no number. All gathers are in flight together, then all
        scatters."""
        owner_of = dict(zip(self.split_matrices(), self.owners()))
        shards, pieces, handles = [], [], []  # pieces: the gathered shards, on the owner only
        for p, group, update in split:
            mesh, dim = p.device_mesh, split_dim(p)
            rows = -(-p.shape[dim] // mesh.size())  # ceil(rows / world): a full shard (along dim)
            shard = pad(update.to(self.ns_dtype or newton_schulz_dtype(update)), dim, rows)
            owned = mesh.get_local_rank() == owner_of[p]
            shards.append(shard)
            pieces.append([torch.empty_like(shard) for _ in range(mesh.size())] if owned else None)
            handles.append(dist.gather(shard, pieces[-1], group=mesh.get_group(), group_dst=owner_of[p],
                                       async_op=True))
        for handle in handles:
            handle.wait()
        results, handles = [], []
        for (p, group, update), shard, gathered in zip(split, shards, pieces):
            mesh, dim = p.device_mesh, split_dim(p)
            if gathered is not None:  # this rank owns p: orthogonalise the whole matrix, cut it into shards
                whole = torch.cat(gathered, dim).narrow(dim, 0, p.shape[dim])  # without the padding
                whole = pad(self.orthogonalize(whole, group["ns_steps"]), dim, mesh.size() * shard.size(dim))
                gathered = [piece.contiguous() for piece in whole.chunk(mesh.size(), dim)]
            result = torch.empty_like(shard)
            handles.append(dist.scatter(result, gathered, group=mesh.get_group(), group_src=owner_of[p],
                                        async_op=True))
            results.append(result.narrow(dim, 0, update.size(dim)))  # without the padding
        for handle in handles:
            handle.wait()
        return results
