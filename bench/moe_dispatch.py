"""
Forward+backward time of the sparse MoE layer against a dense SwiGLU with the same active parameters,
and of a looped model (SMELT r=2) against its unrolled untied twin of the same executed depth.
Both sides of each ratio run in the same process, interleaved, on the same tokens.

    python bench/moe_dispatch.py [--tokens 4096] [--n_embd 256] [--repeats 5]

Prints one JSON line per measurement. Targets on the 2-core CPU: moe/dense <= 1.5, looped/unrolled <= 1.05.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import GPT, MLP, MoE, ModelConfig  # noqa: E402


def time_fwd_bwd(module, x, repeats):
    """Median seconds of forward + backward (after one warm-up)."""
    times = []
    for i in range(repeats + 1):
        x_in = x.detach().requires_grad_(True)
        t0 = time.perf_counter()
        out = module(x_in)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        if i:
            times.append(time.perf_counter() - t0)
        module.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]


def interleaved(a, b, xa, xb, repeats):
    ta, tb = [], []
    for _ in range(repeats):  # alternate so both see the same machine load
        ta.append(time_fwd_bwd(a, xa, 1))
        tb.append(time_fwd_bwd(b, xb, 1))
    return sorted(ta)[len(ta) // 2], sorted(tb)[len(tb) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--n_embd", type=int, default=256)
    ap.add_argument("--n_expert", type=int, default=64)
    ap.add_argument("--top_k", type=int, default=8)
    ap.add_argument("--expert_hidden", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)

    moe_cfg = ModelConfig(n_embd=args.n_embd, n_head=4, n_expert=args.n_expert, top_k=args.top_k,
                          expert_hidden=args.expert_hidden, init="nanogpt")
    dense_cfg = ModelConfig(n_embd=args.n_embd, n_head=4, mlp_hidden=args.top_k * args.expert_hidden)
    moe, dense = MoE(moe_cfg), MLP(dense_cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(args.tokens // 512, 512, args.n_embd)
    t_moe, t_dense = interleaved(moe, dense, x, x, args.repeats)
    print(json.dumps(dict(bench="moe_vs_dense_fwd_bwd", tokens=args.tokens, n_embd=args.n_embd,
                          n_expert=args.n_expert, top_k=args.top_k, expert_hidden=args.expert_hidden,
                          dense_hidden=args.top_k * args.expert_hidden, moe_s=round(t_moe, 4),
                          dense_s=round(t_dense, 4), ratio=round(t_moe / t_dense, 3), target=1.5)))

    # looped r=2 (SMELT layout) vs unrolled untied model with the same executed blocks
    common = dict(vocab_size=512, eot_token=511, block_size=512, n_embd=args.n_embd, n_head=4, init="nanogpt",
                  n_expert=16, top_k=4, expert_hidden=64)
    looped = GPT(ModelConfig(n_layer=4, layout="smelt", n_loops=2, **common))
    unrolled = GPT(ModelConfig(n_layer=looped.config.executed_layers(), **common))
    idx = torch.randint(0, 511, (args.tokens // 512, 512))

    class Loss(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(ids.long(), ids.long())[1]

    t_loop, t_unrolled = interleaved(Loss(looped), Loss(unrolled), idx.float(), idx.float(), args.repeats)
    print(json.dumps(dict(bench="looped_vs_unrolled_fwd_bwd", tokens=args.tokens,
                          executed_layers=looped.config.executed_layers(), looped_s=round(t_loop, 4),
                          unrolled_s=round(t_unrolled, 4), ratio=round(t_loop / t_unrolled, 3), target=1.05)))


if __name__ == "__main__":
    main()
