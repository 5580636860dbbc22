"""The validation loss a run logs ([S] and [X] compare architectures by it): token-weighted cross-entropy
over the same windows of the val split at every eval, per source when the data has several, bits per byte
([X]: comparable across tokenizers), and the MoE router's load. Apart from the loop, as nanochat's."""
import contextlib
import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from data.loader import windows


@torch.no_grad()
def evaluate(model, data, eval_tokens, batch_size, autocast=contextlib.nullcontext()):
    """The windows are spread evenly over the split (every source is in) and shared out across ranks;
    every rank runs as many forwards (under FSDP each is a collective), counting only its own."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device, cfg = next(model.parameters()).device, model.config
    seq_len, n_sources = cfg.block_size, len(data.source_names) if data.val_sources is not None else 0
    total = (len(data.val) - 1) // seq_len
    n_windows = max(1, min(eval_tokens // seq_len, total))
    starts = np.linspace(0, total - 1, n_windows).round().astype(np.int64) * seq_len
    sums = torch.zeros(2, 1 + n_sources, dtype=torch.float64, device=device)  # CE sums, token counts
    text = sums.new_zeros(2)  # [X] bits per byte: the nats of the text targets, their bytes
    router = sums.new_zeros(3)  # balance, z_loss, batches
    expert_counts = sums.new_zeros(cfg.executed_layers(), cfg.n_expert)
    token_bytes = data.token_bytes.to(device)
    mine, was_training = list(range(rank, n_windows, world)), model.training
    model.eval()
    for i in range(0, math.ceil(math.ceil(n_windows / world) / batch_size) * batch_size, batch_size):
        offsets = starts[mine[i:i + batch_size] or [0]]
        rows = torch.from_numpy(windows(data.val, offsets, seq_len)).to(device)
        x, y = rows[:, :-1], rows[:, 1:]
        with autocast:
            logits, _, stats = model(x, y, return_stats=True)
        if i >= len(mine):  # a forward the other ranks need, not counted
            continue
        ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").double()
        sums[:, 0] += torch.stack([ce.sum(), ce.new_tensor(ce.numel())])
        n_bytes = token_bytes[y.flatten()].double()
        text += torch.stack([(ce * (n_bytes > 0)).sum(), n_bytes.sum()])
        if n_sources:
            src = np.stack([data.val_sources[o + 1:o + seq_len + 1] for o in offsets]).astype(np.int64)
            src = torch.from_numpy(src).to(device)
            sums[0, 1:] += sums.new_zeros(n_sources).index_add_(0, src.flatten(), ce)
            sums[1, 1:] += torch.bincount(src.flatten(), minlength=n_sources).double()
        if "balance" in stats:
            router += torch.stack([stats["balance"], stats["z_loss"], stats["ce"].new_ones(())]).double()
            expert_counts += stats["expert_counts"].double()
    model.train(was_training)
    if world > 1:
        for t in (sums, text, router, expert_counts):
            dist.all_reduce(t)
    out = {"val_loss": (sums[0, 0] / sums[1, 0]).item(),
           "val_bpb": (text[0] / (math.log(2) * text[1])).item()}
    if n_sources:
        out["val_loss_by_source"] = {name: (sums[0, 1 + j] / sums[1, 1 + j]).item()
                                     for j, name in enumerate(data.source_names) if sums[1, 1 + j] > 0}
    if cfg.n_expert:
        fraction = expert_counts / expert_counts.sum(dim=-1, keepdim=True).clamp(min=1)
        balance, z_loss = (router[:2] / router[2].clamp(min=1)).tolist()
        out.update(balance=balance, z_loss=z_loss, expert_load_max=fraction.max().item(),
                   expert_load_min=fraction.min().item())
    return out
