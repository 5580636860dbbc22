"""
Muon: MomentUm Orthogonalized by Newton-Schulz (Keller Jordan; as in modded-nanogpt and nanochat), for
the hidden matrices of a transformer. One file with no project imports: copy it into any project.

    from muon import Muon
    opt = Muon(hidden_matrices, lr=0.02, momentum=0.95)      # 2-D (out, in) or stacked experts (E, out, in)

The update of each matrix is SGD momentum (Nesterov by default), orthogonalised by five steps of the
quintic Newton-Schulz iteration (orthogonalize), scaled by lr * max(1, rows/cols)^0.5 so that tall
matrices get the same RMS update per element. A stacked expert tensor (E, out, in) is orthogonalised
per expert. Decoupled weight decay p <- p (1 - lr wd).
"""

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic (a, b, c): maximal slope at 0, 5 steps suffice


def orthogonalize(update, steps=5, eps=1e-7, dtype=None, gram=None):
    """Newton-Schulz quintic iteration: X <- a X + (b A + c A^2) X with A = X X^T, `steps` times, after
    X = G / ||G||_F (so every singular value starts <= 1). The coefficients maximise the slope at 0, so
    small singular values grow fast; the result is U S' V^T with S' in ~[0.7, 1.2], not exactly 1,
    which is all Muon needs. Batched over leading dims: a stacked expert tensor (E, out, in) is
    orthogonalised per expert.
    dtype: the arithmetic dtype; None -> bfloat16 on CUDA (as the references), float32 elsewhere (CPUs
    have no fast bf16). Pass torch.bfloat16 on CPU to rehearse the CUDA arithmetic.
    gram: x -> x @ x.mT (kernels.newton_schulz passes its half-tile Triton kernel)."""
    a, b, c = NS_COEFFICIENTS
    if dtype is None:
        dtype = torch.bfloat16 if update.is_cuda else torch.float32
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


class Muon(torch.optim.Optimizer):
    """Muon for 2-D (out, in) and stacked 3-D (E, out, in) parameters. See the module docstring.
    ns_dtype: the Newton-Schulz arithmetic dtype (None: bf16 on CUDA, fp32 on CPU).
    use_triton: None -> kernels.newton_schulz (half-tile Gram kernel) on CUDA, plain matmuls elsewhere."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0,
                 ns_dtype=None, use_triton=None):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      weight_decay=weight_decay))
        self.ns_dtype, self.use_triton = ns_dtype, use_triton

    def momentum_update(self, p, group):
        """The Nesterov (or plain) momentum direction of p; the buffer lives in self.state[p]."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf = state["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(p.grad)
        return p.grad.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf

    def orthogonalize(self, update, steps):
        if update.is_cuda if self.use_triton is None else self.use_triton:
            from kernels import newton_schulz  # the same iteration, Gram products on Triton
            return newton_schulz(update, steps, dtype=self.ns_dtype)
        return orthogonalize(update, steps, dtype=self.ns_dtype)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr = group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = self.orthogonalize(self.momentum_update(p, group), group["ns_steps"])
                if group["weight_decay"]:
                    p.mul_(1 - lr * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-lr * muon_lr_scale(p.shape))
