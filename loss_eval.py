"""
The validation loss a run logs ([S] and [X] compare architectures by it): the
cross-entropy over the same val windows at every eval, per source; bits per byte,
comparable across tokenizers [X]; the MoE router's load.
"""
import contextlib
import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from data.loader import windows


@torch.no_grad()
def evaluate(model, data, eval_tokens, batch_size, autocast=contextlib.nullcontext()):
    """val_loss, val_bpb and the router's statistics of model on data's val split."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device, cfg = next(model.parameters()).device, model.config
    seq_len = cfg.block_size
    n_sources = len(data.source_names) if data.val_sources is not None else 0
    total = (len(data.val) - 1) // seq_len
    n_windows = max(1, min(eval_tokens // seq_len, total))
    # The windows are spread evenly over the split, so every source is in.
    starts = np.linspace(0, total - 1, n_windows).round().astype(np.int64) * seq_len
    # Cross-entropy sums (row 0) and token counts (row 1), per source after column 0.
    sums = torch.zeros(2, 1 + n_sources, dtype=torch.float64, device=device)
    # Bits per byte: the nats of the text targets (not eot), their bytes.
    text = sums.new_zeros(2)
    # The router's balance and z_loss sums, and the batches.
    router = sums.new_zeros(3)
    expert_counts = sums.new_zeros(cfg.executed_layers(), cfg.n_expert)
    token_bytes = data.token_bytes.to(device)
    mine, was_training = list(range(rank, n_windows, world)), model.training
    model.eval()
    # The windows are shared out across ranks. Every rank runs as many forwards
    # (under FSDP each is a collective): one with none left reruns window 0.
    n_batches = math.ceil(math.ceil(n_windows / world) / batch_size)
    for i in range(0, n_batches * batch_size, batch_size):
        offsets = starts[mine[i:i + batch_size] or [0]]
        rows = torch.from_numpy(windows(data.val, offsets, seq_len)).to(device)
        x, y = rows[:, :-1], rows[:, 1:]
        with autocast:
            logits, _, stats = model(x, y, return_stats=True)
        if i >= len(mine):
            # Not counted.
            continue
        logits = logits.float().flatten(0, 1)
        ce = F.cross_entropy(logits, y.flatten(), reduction="none").double()
        sums[:, 0] += torch.stack([ce.sum(), ce.new_tensor(ce.numel())])
        # Bits per byte leaves out the eot targets: they have no bytes.
        n_bytes = token_bytes[y.flatten()].double()
        text += torch.stack([(ce * (n_bytes > 0)).sum(), n_bytes.sum()])
        if n_sources:
            # The source of each target token.
            src = [data.val_sources[o + 1:o + seq_len + 1] for o in offsets]
            src = torch.from_numpy(np.stack(src).astype(np.int64)).to(device).flatten()
            sums[0, 1:] += sums.new_zeros(n_sources).index_add_(0, src, ce)
            sums[1, 1:] += torch.bincount(src, minlength=n_sources).double()
        if "balance" in stats:
            batch = [stats["balance"], stats["z_loss"], stats["ce"].new_ones(())]
            router += torch.stack(batch).double()
            expert_counts += stats["expert_counts"].double()
    model.train(was_training)
    # Every rank ends with the sums over all ranks.
    if world > 1:
        for t in (sums, text, router, expert_counts):
            dist.all_reduce(t)
    out = {
        "val_loss": (sums[0, 0] / sums[1, 0]).item(),
        "val_bpb": (text[0] / (math.log(2) * text[1])).item(),
    }
    if n_sources:
        out["val_loss_by_source"] = {
            name: (sums[0, 1 + j] / sums[1, 1 + j]).item()
            for j, name in enumerate(data.source_names)
            if sums[1, 1 + j] > 0
        }
    if cfg.n_expert:
        # Each layer's share of tokens per expert.
        per_layer = expert_counts.sum(dim=-1, keepdim=True).clamp(min=1)
        fraction = expert_counts / per_layer
        balance, z_loss = (router[:2] / router[2].clamp(min=1)).tolist()
        out.update(
            balance=balance,
            z_loss=z_loss,
            expert_load_max=fraction.max().item(),
            expert_load_min=fraction.min().item(),
        )
    return out
