"""The validation loss a run logs ([S] and [X] both compare architectures by it): token-weighted cross
entropy over the same windows of the val split at every eval, per source when the data has sources,
bits per byte ([X]: comparable across tokenizers), and the MoE router's load. train.py calls it at
every eval; in the style of nanochat's loss_eval.py, it is apart from the training loop.
"""
import contextlib
import math

import numpy as np
import torch
import torch.nn.functional as F

from data.loader import to_device, windows
from tooling import distributed


@torch.no_grad()
def evaluate(model, data, config, autocast=contextlib.nullcontext(), rank=0, world=1, final=False):
    """Token-weighted validation CE over config.eval_tokens (final_eval_tokens, when set, at the
    last step) of the val split (the same windows every eval, evenly spread over the split so every
    source is in; split across ranks), per source when sources exist, bits per byte (comparable
    across tokenizers), and router statistics for MoE. Every rank runs the same number of forwards
    (under FSDP each is a collective); a rank out of windows runs one it does not count."""
    device = next(model.parameters()).device
    n_sources = len(data.source_names) if data.val_sources is not None else 0
    seq_len, batch_size = model.config.block_size, config.batch_size
    total = (len(data.val_tokens) - 1) // seq_len
    tokens = config.final_eval_tokens if final and config.final_eval_tokens else config.eval_tokens
    n_windows = max(1, min(tokens // seq_len, total))
    starts = np.linspace(0, total - 1, n_windows).round().astype(np.int64) * seq_len  # all sources
    sums = torch.zeros(2, 1 + n_sources, dtype=torch.float64, device=device)  # CE sums, tokens
    router = sums.new_zeros(3)  # balance, z_loss, batches
    token_bytes = data.token_bytes.to(device)
    text = sums.new_zeros(2)  # [X] bits per byte: the nats of the text targets, their bytes
    expert_counts = sums.new_zeros(model.config.executed_layers(), model.config.n_expert)
    mine = list(range(rank, n_windows, world))
    was_training = model.training
    model.eval()
    per_rank = math.ceil(n_windows / world)
    for i in range(0, math.ceil(per_rank / batch_size) * batch_size, batch_size):
        offsets = starts[mine[i:i + batch_size] or [0]]
        rows = to_device(windows(data.val_tokens, offsets, seq_len), device)
        x, y = rows[:, :-1], rows[:, 1:]
        with autocast:
            logits, _, stats = model(x, y, return_stats=True)
        if i >= len(mine):  # a forward the other ranks need, not counted
            continue
        ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").double()
        sums[:, 0] += torch.stack([ce.sum(), ce.new_tensor(ce.numel())])
        n_bytes = token_bytes[y.flatten()].double()  # no masked indexing: no host sync
        text += torch.stack([(ce * (n_bytes > 0)).sum(), n_bytes.sum()])
        if n_sources:
            src = np.stack([data.val_sources[o + 1:o + seq_len + 1] for o in offsets])
            src = to_device(src, device)
            sums[0, 1:] += sums.new_zeros(n_sources).index_add_(0, src.flatten(), ce)
            sums[1, 1:] += torch.bincount(src.flatten(), minlength=n_sources).double()
        if "balance" in stats:
            one = stats["ce"].new_ones(())
            router += torch.stack([stats["balance"], stats["z_loss"], one]).double()
            expert_counts += stats["expert_counts"].double()
    model.train(was_training)
    sums, router, expert_counts, text = (distributed.all_reduce(t) if t.numel() else t
                                         for t in (sums, router, expert_counts, text))
    out = {"val_loss": (sums[0, 0] / sums[1, 0]).item(),
           "val_bpb": (text[0] / (math.log(2) * text[1])).item()}
    if n_sources:
        out["val_loss_by_source"] = {name: (sums[0, 1 + j] / sums[1, 1 + j]).item() for j, name
                                     in enumerate(data.source_names) if sums[1, 1 + j] > 0}
    if model.config.n_expert:
        fraction = expert_counts / expert_counts.sum(dim=-1, keepdim=True).clamp(min=1)
        balance, z_loss = (router[:2] / router[2].clamp(min=1)).tolist()
        out.update(balance=balance, z_loss=z_loss, expert_load_max=fraction.max().item(),
                   expert_load_min=fraction.min().item())
    return out
