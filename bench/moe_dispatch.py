"""
Forward+backward time of the sparse MoE layer against a dense SwiGLU with the same active parameters,
and of a looped model (SMELT r=2) against its unrolled untied twin of the same executed depth.
Both sides of each ratio run in the same process, interleaved, on the same tokens.

    python bench/moe_dispatch.py [--tokens 4096] [--n_embd 256] [--repeats 5] [--threads 1] [--glibc_default]

Prints one JSON line per measurement. Targets on the 2-core CPU: moe/dense <= 1.5, looped/unrolled <= 1.05.
The process keeps freed memory as train.py does on a CPU (tooling.distributed.keep_freed_memory);
--glibc_default measures glibc's default, where the MoE's 32 MiB temporaries pay page faults every step
(ratio_user leaves out that system time: see time_fwd_bwd).
"""

import json
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import GPT, MLP, MoE, ModelConfig  # noqa: E402
from tooling.common import number, parser  # noqa: E402
from tooling.distributed import keep_freed_memory  # noqa: E402


def time_fwd_bwd(module, x):
    """(wall, cpu, user, system) seconds of one forward + backward. CPU time is the steadier figure on a shared
    machine; its system part is mostly page faults: glibc hands blocks of 32 MiB and more back to the kernel
    when they are freed, and the next step faults them in again, page by page."""
    x_in = x.detach().requires_grad_(True)
    wall, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    out = module(x_in)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()
    wall, after = time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_SELF)
    module.zero_grad(set_to_none=True)
    user, system = after.ru_utime - usage.ru_utime, after.ru_stime - usage.ru_stime
    return wall, user + system, user, system


def interleaved(a, b, xa, xb, repeats):
    """Median (wall, cpu) of a and of b, alternating runs so both see the same machine load."""
    time_fwd_bwd(a, xa), time_fwd_bwd(b, xb)  # warm-up
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(time_fwd_bwd(a, xa))
        tb.append(time_fwd_bwd(b, xb))

    def medians(ts):
        return [sorted(t[i] for t in ts)[len(ts) // 2] for i in range(4)]
    return medians(ta), medians(tb)


def report(bench, a_name, b_name, ta, tb, target, **info):
    times = {f"{name}_{kind}_s": round(t[i], 4) for name, t in ((a_name, ta), (b_name, tb))
             for i, kind in enumerate(("wall", "cpu", "user", "system"))}
    print(json.dumps(dict(bench=bench, **info, **times, ratio_wall=round(ta[0] / tb[0], 3),
                          ratio_cpu=round(ta[1] / tb[1], 3), ratio_user=round(ta[2] / tb[2], 3), target=target)))


def main():
    ap = parser("bench/moe_dispatch.py")
    ap.add_argument("--tokens", type=number(int, 1), default=4096)
    ap.add_argument("--n_embd", type=number(int, 1), default=256)
    ap.add_argument("--n_expert", type=number(int, 1), default=64)
    ap.add_argument("--top_k", type=number(int, 1), default=8)
    ap.add_argument("--expert_hidden", type=number(int, 1), default=64)
    ap.add_argument("--repeats", type=number(int, 1), default=5)
    ap.add_argument("--threads", type=number(int, 1), default=1, help="torch threads (1: as bench/efficiency.py; small expert "
                                                             "matmuls gain little from a second core, the dense one does)")
    ap.add_argument("--glibc_default", action="store_true", help="leave glibc's allocator as it is (train.py keeps "
                                                                 "freed memory on a CPU)")
    args = ap.parse_args()
    allocator = "glibc default" if args.glibc_default else keep_freed_memory().removeprefix("allocator: ")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    moe_cfg = ModelConfig(n_embd=args.n_embd, n_head=4, n_expert=args.n_expert, top_k=args.top_k,
                          expert_hidden=args.expert_hidden, init="nanogpt")
    dense_cfg = ModelConfig(n_embd=args.n_embd, n_head=4, mlp_hidden=args.top_k * args.expert_hidden)
    moe, dense = MoE(moe_cfg), MLP(dense_cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(args.tokens // 512, 512, args.n_embd)
    t_moe, t_dense = interleaved(moe, dense, x, x, args.repeats)
    report("moe_vs_dense_fwd_bwd", "moe", "dense", t_moe, t_dense, 1.5, tokens=args.tokens, n_embd=args.n_embd,
           n_expert=args.n_expert, top_k=args.top_k, expert_hidden=args.expert_hidden,
           dense_hidden=args.top_k * args.expert_hidden, threads=torch.get_num_threads(), allocator=allocator)

    # looped r=2 (SMELT layout) vs unrolled untied model with the same executed blocks
    common = dict(vocab_size=512, eot_token=511, block_size=512, n_embd=args.n_embd, n_head=4, init="nanogpt",
                  n_expert=16, top_k=4, expert_hidden=64)
    looped = GPT(ModelConfig(n_layer=4, layout="smelt", n_passes=2, **common))
    unrolled = GPT(ModelConfig(n_layer=looped.config.executed_layers(), **common))
    idx = torch.randint(0, 511, (args.tokens // 512, 512))

    class Loss(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(ids.long(), ids.long())[1]

    t_loop, t_unrolled = interleaved(Loss(looped), Loss(unrolled), idx.float(), idx.float(), args.repeats)
    report("looped_vs_unrolled_fwd_bwd", "looped", "unrolled", t_loop, t_unrolled, 1.05, tokens=args.tokens,
           executed_layers=looped.config.executed_layers(), threads=torch.get_num_threads(),
           allocator=allocator)


if __name__ == "__main__":
    main()
