"""
What the second visit does: SMELT's mechanistic probes [S §6] and the KL effective depth [X].

    python probe.py --ckpt out/ckpt.pt                      # text report on 16,384 held-out tokens
    python probe.py --ckpt out/ckpt.pt --tokens 65536 --json # one JSON object on stdout
    python probe.py --ckpt out/ckpt.pt --plot out/probe      # + sink heatmaps and the KL curve (matplotlib)

Held-out tokens are evenly spaced, non-overlapping windows of the checkpoint's validation split
(data.shards.load_split(data_dir, "val"); --data_dir overrides the checkpoint's). One forward with
record_blocks(model) hooks into every block and gives one record per executed block, labelled
(physical block, visit); the model's forward pass itself carries no probe code.
A physical block executed at visits a and b (default 1 and 2) is a "loop layer"; for each we report

  1. routing   |topk(visit a) ∩ topk(visit b)| per token, against k^2/n for independent routing
  2. residual  visit-b / visit-a ratios of mean L2 norms of the full update (attn + ffn write [S8]-[S9]),
               the attention write, the FFN/MoE write and the RMSNorm input of the FFN sublayer; cosine
               of the full updates of the same layer across visits vs mismatched layers (i at a, j≠i at b)
  3. attention cross-visit cosines of X, Q, K, V, PV, O [S10]; top-8 attended keys of each head,
               overlap across visits (same head) vs a same-layer other-head control (head h at visit a
               vs head g != h at visit b), over queries with at least 16 attendable keys
  4. sink      attention mass on the first token of the query's document: the eot that starts it, or
               the window's first token for a document that began before the window (attention cannot
               see further back, so that token plays the BOS); per head, per visit, and for every
               executed block (the depth trend of the sink); document-start queries are left out
  5. KL depth  logit lens: KL(final || lens(resid after block i)) for every executed block, and the
               KL effective depth (see kl_effective_depth)

Means are token-weighted over all windows; the norm ratios are ratios of mean norms.

A model without repeated blocks (plain, untied prelude-core-coda) has no loop layers: its visit
statistics are reported as not applicable (None in JSON, "n/a" in text); the sink table and the KL
depth are still computed. Every statistic is a pure function of tensors so it can be tested alone.
"""

import argparse
import contextlib
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from model import MAX_PASSES, PASSES_WHY, scaled
from sample import check_n_passes
from tooling import common, rundir
from tooling.common import cli_error, fmt, number, resolve_device, write_atomic
from tooling.checkpoint import load_model

ATTENTION_QUANTITIES = (("X", "attn_in"), ("Q", "q"), ("K", "k"), ("V", "v"), ("PV", "attn_context"),
                        ("O", "attn_output"))
WRITES = ("update", "attn", "ffn", "ffn_in")  # the four norm ratios of [S §6]
# one probe forward keeps every executed block's attention probabilities (float32, B x heads x T x T) until
# its statistics are taken: at most this many bytes of them, or the probe is refused before it runs
MAX_RECORDED_BYTES = 8 << 30


# ----------------------------------------------------------------------------------------------------
# Statistics: pure functions of tensors


def routing_overlap(ids_a, ids_b):
    """Mean size of the intersection of two top-k expert sets per token. ids: (..., k) distinct ids."""
    if ids_a.shape != ids_b.shape:
        raise ValueError(f"expert id shapes differ: {tuple(ids_a.shape)} vs {tuple(ids_b.shape)}")
    same = ids_a.unsqueeze(-1) == ids_b.unsqueeze(-2)  # (..., k, k)
    return same.any(dim=-1).sum(dim=-1).float().mean().item()


def random_routing_overlap(top_k, n_expert):
    """Expected overlap of two independent uniformly random top-k sets of n experts: k * (k/n) = k^2/n."""
    return top_k * top_k / n_expert


def mean_norm(x):
    """Mean L2 norm of the last dimension over every other index (token, head)."""
    return x.float().norm(dim=-1).mean().item()


def norm_ratio(x_b, x_a):
    """Ratio of mean norms, visit b over visit a. A ratio of means, not a mean of per-token ratios,
    so a few near-zero visit-a updates cannot dominate it."""
    return mean_norm(x_b) / mean_norm(x_a)


def mean_cosine(x_a, x_b, eps=1e-12):
    """Cosine along the last dimension (per token, per head), averaged over everything else."""
    return F.cosine_similarity(x_a.float(), x_b.float(), dim=-1, eps=eps).mean().item()


def cross_visit_cosine_matrix(updates_a, updates_b):
    """C[i, j] = mean cosine of layer i's update at visit a and layer j's at visit b. The diagonal is
    the same-layer cosine, off-diagonal entries are the mismatched cross-visit control [S §6]."""
    n = len(updates_a)
    return torch.tensor([[mean_cosine(updates_a[i], updates_b[j]) for j in range(n)] for i in range(n)],
                        dtype=torch.float64)


def same_and_mismatched(matrix):
    """(mean of the diagonal, mean of the off-diagonal or None when there is a single layer)."""
    n = matrix.size(0)
    same = matrix.diagonal().mean().item()
    if n < 2:
        return same, None
    off = (matrix.sum() - matrix.diagonal().sum()) / (n * n - n)
    return same, off.item()


def document_starts(idx, eot_token):
    """Position of the first token of each position's document (B, T): the eot that starts it, or 0
    for text before the window's first eot (the first visible token; attention never sees further)."""
    positions = torch.arange(idx.size(1), device=idx.device).expand_as(idx)
    return torch.where(idx == eot_token, positions, torch.zeros_like(positions)).cummax(dim=1).values


def attendable_keys(starts):
    """Number of keys each query may attend to under the causal document mask (B, T)."""
    return torch.arange(starts.size(1), device=starts.device) - starts + 1


def sink_mass(probs, starts):
    """Attention mass on the query's document-start token, per head (H,), averaged over queries that
    are not themselves a document start (those attend only to themselves: mass 1 by construction).
    probs (B, H, T, T), starts (B, T) from document_starts. Returns (per-head masses, number of queries)."""
    B, H, T, _ = probs.shape
    at_start = probs.gather(-1, starts[:, None, :, None].expand(B, H, T, 1)).squeeze(-1)  # (B, H, T)
    keep = starts != torch.arange(T, device=starts.device)  # (B, T)
    n = int(keep.sum())
    if n == 0:
        return torch.full((H,), float("nan"), dtype=torch.float64), 0
    return (at_start.double() * keep[:, None]).sum(dim=(0, 2)) / n, n


def topk_attention_overlap(probs_a, probs_b, n_keys, k=8):
    """M[h, g] = mean over queries of |top-k keys of head h at visit a ∩ top-k keys of head g at visit b| / k.
    The diagonal is the same-head cross-visit overlap; off-diagonal entries are the other-head control.
    Only queries with at least 2k attendable keys count (fewer keys make any two top-k sets overlap
    by construction). probs (B, H, T, T), n_keys (B, T). Returns (M (H, H), number of queries)."""
    valid = n_keys >= 2 * k  # (B, T)
    n = int(valid.sum())
    H = probs_a.size(1)
    if n == 0:
        return torch.full((H, H), float("nan"), dtype=torch.float64), 0
    top_a = probs_a.topk(k, dim=-1).indices.permute(0, 2, 1, 3)[valid]  # (n, H, k)
    top_b = probs_b.topk(k, dim=-1).indices.permute(0, 2, 1, 3)[valid]
    matrix = torch.empty(H, H, dtype=torch.float64, device=probs_a.device)
    for h in range(H):  # one head of visit a against every head of visit b: (n, H, k, k) booleans
        same = top_a[:, h, None, :, None] == top_b[:, :, None, :]
        matrix[h] = same.any(dim=-1).sum(dim=-1).double().mean(dim=0) / k
    return matrix.cpu(), n


def diagonal_and_control(matrix):
    """Per-head same-head value (H,) and per-head mean over the other heads (H,), None if one head."""
    H = matrix.size(0)
    same = matrix.diagonal().clone()
    if H < 2:
        return same, None
    return same, (matrix.sum(dim=1) - same) / (H - 1)


def kl_to_final(final_logits, lens_logits):
    """Mean over tokens of KL(p_final || p_lens) in nats; logits (..., vocab)."""
    log_p = final_logits.float().log_softmax(dim=-1)
    log_q = lens_logits.float().log_softmax(dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).mean().item()


def kl_effective_depth(kl_curve, threshold=2.0):
    """KL effective depth [X]: kl_curve[i] is the KL(final || logit lens) after executed block i+1.
    Depth = the 1-based number of the first executed block after the KL peak (first maximum) whose KL
    is <= threshold nats. Returns dict(depth, peak, peak_kl, status) with status
      "ok"                    depth found and the peak rose above the threshold,
      "peak_within_threshold" depth found by the same rule, but the curve never left the threshold band
                              (e.g. an untrained model): the number says little,
      "peak_is_last"          the peak is the last block: nothing comes after it, depth None,
      "never"                 no block after the peak gets within the threshold, depth None."""
    kl = [float(v) for v in kl_curve]
    if not kl:
        raise ValueError("kl_curve is empty: the model executed no block")
    peak = max(range(len(kl)), key=lambda i: (kl[i], -i))  # first maximum
    result = dict(depth=None, peak=peak + 1, peak_kl=kl[peak], threshold=threshold)
    if peak == len(kl) - 1:
        return dict(result, status="peak_is_last")
    for i in range(peak + 1, len(kl)):
        if kl[i] <= threshold:
            return dict(result, depth=i + 1, status="ok" if kl[peak] > threshold else "peak_within_threshold")
    return dict(result, status="never")


@contextlib.contextmanager
def record_blocks(model):
    """Forward hooks that fill a list with one record per executed block, in execution order:
    block, visit (1-based count of that physical block's executions in this forward), resid_in,
    resid_out, attn_in (the normed input X), q/k/v (rotated), attn_probs and attn_context (softmax(q k^T)
    and its product with v, recomputed explicitly from the block's own q/k/v: SDPA returns neither),
    attn_output (O), attn_update and ffn_update (the scaled residual writes [S8]-[S9]), ffn_in, and
    expert_ids / expert_weights for MoE blocks. Use one `with` per forward."""
    records, handles = [], []
    index = {id(block): i for i, block in enumerate(model.blocks)}

    def open_record(block, args):
        i = index[id(block)]
        visit = 1 + sum(r["block"] == i for r in records)
        records.append(dict(block=i, visit=visit))

    def close_record(block, args, output):
        (x, scale, _), (output, _) = args, output
        r = records[-1]
        update_scale = scale * block.residual_multiplier  # as Block.forward scales both writes
        r.update(resid_in=x.detach(), resid_out=output.detach(), attn_update=scaled(r["attn_output"], update_scale),
                 ffn_update=scaled(r.pop("ffn_output"), update_scale))

    def attention(attn, args, output):
        x, ctx = args
        q, k, v = attn.qkv(x, ctx)
        rep = attn.n_head // attn.n_kv_head
        scores = q @ k.repeat_interleave(rep, dim=1).transpose(-2, -1) / math.sqrt(attn.head_dim)
        mask = ctx.mask
        if mask is None:  # plain causal
            mask = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=x.device).tril()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        records[-1].update(q=q.detach(), k=k.detach(), v=v.detach(), attn_probs=probs.detach(),
                           attn_context=(probs @ v.repeat_interleave(rep, dim=1)).detach(),
                           attn_output=output.detach())

    def ffn(module, args, output):
        out, router = output
        records[-1]["ffn_output"] = out.detach()
        if router is not None:
            records[-1].update(expert_ids=router["expert_ids"].detach(), expert_weights=router["weights"].detach())

    def store(key):
        def hook(module, args, output):
            records[-1][key] = output.detach()
        return hook

    for block in model.blocks:
        handles += [block.register_forward_pre_hook(open_record), block.register_forward_hook(close_record),
                    block.norm1.register_forward_hook(store("attn_in")),
                    block.attn.register_forward_hook(attention),
                    block.norm2.register_forward_hook(store("ffn_in")),
                    block.ffn.register_forward_hook(ffn)]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def logit_lens(model, resid):
    """Decode a residual stream with the model's own final norm and head (and [X] output multiplier)."""
    return scaled(model.lm_head(model.norm_f(resid)), model.config.output_multiplier)


# ----------------------------------------------------------------------------------------------------
# Running the probes on a model


class WeightedMeans:
    """Weighted running means of named values (floats or tensors) accumulated over micro-batches."""

    def __init__(self):
        self.sums, self.weights = {}, {}

    def add(self, key, value, weight):
        if weight <= 0:
            return
        value = value.double().cpu() if torch.is_tensor(value) else float(value)
        self.sums[key] = self.sums.get(key, 0.0) + value * weight
        self.weights[key] = self.weights.get(key, 0) + weight

    def get(self, key):
        return self.sums[key] / self.weights[key] if key in self.sums else None


def loop_layers(executed, visits):
    """Physical blocks executed at both visits (a, b), in order of first execution."""
    a, b = visits
    seen_a = {blk for blk, v in executed if v == a}
    return [blk for blk, v in executed if v == b and blk in seen_a]


@torch.no_grad()
def run_probes(model, idx, visits=(1, 2), n_passes=None, batch_size=8, attn_topk=8, kl_threshold=2.0,
               progress=False):
    """All probes on token windows idx (B, T), micro-batch by micro-batch. Returns a JSON-ready dict."""
    a, b = visits
    if a == b or min(visits) < 1:
        raise ValueError(f"visits must be two different 1-based visit numbers, got {visits}")
    model.eval()
    cfg = model.config
    device = next(model.parameters()).device
    means = WeightedMeans()
    executed, layers = None, None
    batches = range(0, idx.size(0), batch_size)
    for start in tqdm(batches, desc="probe", disable=not progress):
        x = idx[start:start + batch_size].to(device)
        n_tok = x.numel()
        with record_blocks(model) as records:
            final_logits, _ = model(x, n_passes=n_passes)
        if executed is None:
            executed = [(r["block"], r["visit"]) for r in records]
            layers = loop_layers(executed, visits)
        by_key = {(r["block"], r["visit"]): r for r in records}
        starts = document_starts(x, cfg.eot_token)
        for i, r in enumerate(records):  # every executed block: KL lens [X] and sink mass
            means.add(("kl", i), kl_to_final(final_logits, logit_lens(model, r["resid_out"])), n_tok)
            mass, n_q = sink_mass(r["attn_probs"], starts)
            means.add(("sink", i), mass, n_q)
        updates = {}
        for blk in layers:
            ra, rb = by_key[(blk, a)], by_key[(blk, b)]
            for v, r in ((a, ra), (b, rb)):
                writes = dict(update=r["resid_out"] - r["resid_in"], attn=r["attn_update"],
                              ffn=r["ffn_update"], ffn_in=r["ffn_in"])
                updates[(blk, v)] = writes["update"]
                for name, t in writes.items():
                    means.add(("norm", blk, v, name), mean_norm(t), n_tok)
            if "expert_ids" in ra:
                means.add(("routing", blk), routing_overlap(ra["expert_ids"], rb["expert_ids"]), n_tok)
            for name, key in ATTENTION_QUANTITIES:
                means.add(("cos", blk, name), mean_cosine(ra[key], rb[key]), n_tok)
            overlap, n_q = topk_attention_overlap(ra["attn_probs"], rb["attn_probs"], attendable_keys(starts),
                                                  attn_topk)
            means.add(("topk", blk), overlap, n_q)
        if layers:
            matrix = cross_visit_cosine_matrix([updates[(blk, a)] for blk in layers],
                                               [updates[(blk, b)] for blk in layers])
            means.add(("update_cos",), matrix, n_tok)
        del records, by_key, updates
    return summarize(model, means, executed, layers, visits, idx.numel(), attn_topk, kl_threshold)


def _list(t):
    return None if t is None else [None if math.isnan(v) else v for v in t.tolist()]


def _ratio(num, den):
    return None if not den else num / den  # a write that is exactly zero at visit a has no ratio


def _mean_or_none(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def summarize(model, means, executed, layers, visits, n_tokens, attn_topk, kl_threshold):
    """Turn accumulated means into the report dict (plain floats, lists and None)."""
    cfg = model.config
    a, b = visits
    kl_curve = [means.get(("kl", i)) for i in range(len(executed))]
    sink = [dict(block=blk, visit=v, mean=_mean_or_none(_list(means.get(("sink", i))) or []),
                 per_head=_list(means.get(("sink", i)))) for i, (blk, v) in enumerate(executed)]
    out = dict(layout=cfg.layout, n_layer=cfg.n_layer, executed_blocks=len(executed), n_tokens=n_tokens,
               visits=list(visits), attn_topk=attn_topk, looped=bool(layers), loop_layers=layers,
               execution=[dict(block=blk, visit=v) for blk, v in executed],
               kl=dict(curve=kl_curve, **kl_effective_depth(kl_curve, kl_threshold)), sink=sink)
    if not layers:
        out.update(layers=None, summary=None, update_cosine=None)
        return out
    sink_at = {(s["block"], s["visit"]): s for s in sink}
    per_layer = []
    for blk in layers:
        routing = means.get(("routing", blk))
        overlap = means.get(("topk", blk))  # None when no query had 2k attendable keys
        same, control = diagonal_and_control(overlap) if overlap is not None else (None, None)
        per_layer.append(dict(
            block=blk,
            routing_overlap=routing,
            routing_random=random_routing_overlap(cfg.top_k, cfg.n_expert) if routing is not None else None,
            norm_ratio={w: _ratio(means.get(("norm", blk, b, w)), means.get(("norm", blk, a, w))) for w in WRITES},
            cosine={name: means.get(("cos", blk, name)) for name, _ in ATTENTION_QUANTITIES},
            topk_overlap_same_head=_mean_or_none(_list(same) or []),
            topk_overlap_other_head=_mean_or_none(_list(control)) if control is not None else None,
            topk_overlap_per_head=_list(same),
            sink_visit_a=sink_at[(blk, a)]["mean"], sink_visit_b=sink_at[(blk, b)]["mean"],
            sink_per_head_visit_a=sink_at[(blk, a)]["per_head"], sink_per_head_visit_b=sink_at[(blk, b)]["per_head"]))
    matrix = means.get(("update_cos",))
    same_cos, mismatched_cos = same_and_mismatched(matrix)
    out["layers"] = per_layer
    out["update_cosine"] = dict(matrix=matrix.tolist(), same_layer=same_cos, mismatched=mismatched_cos)
    keys = ("routing_overlap", "topk_overlap_same_head", "topk_overlap_other_head", "sink_visit_a", "sink_visit_b")
    summary = {key: _mean_or_none([layer[key] for layer in per_layer]) for key in keys}
    summary["routing_random"] = per_layer[0]["routing_random"]
    summary["norm_ratio"] = {w: _mean_or_none([layer["norm_ratio"][w] for layer in per_layer]) for w in WRITES}
    summary["cosine"] = {n: _mean_or_none([layer["cosine"][n] for layer in per_layer]) for n, _ in ATTENTION_QUANTITIES}
    summary["update_cosine_same_layer"], summary["update_cosine_mismatched"] = same_cos, mismatched_cos
    out["summary"] = summary
    return out


# ----------------------------------------------------------------------------------------------------
# Held-out tokens


def resolve_data_dir(data_dir):
    """A data_dir as stored in a checkpoint: as given, or relative to this repository."""
    if not data_dir:
        raise ValueError("no data directory: the checkpoint has no 'data_dir'; pass --data_dir DIR")
    if os.path.isabs(data_dir) or os.path.exists(data_dir):
        return data_dir
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), data_dir)
    return here if os.path.exists(here) else data_dir


def load_val_tokens(data_dir, eot_token=None):
    """The validation split of a prepared data directory (data/prepare.py's format), with clear errors;
    eot_token, if given, must be the separator the data was prepared with."""
    try:
        from data.shards import load_meta, load_split
    except ImportError as e:
        raise ValueError(f"cannot load held-out tokens: data.shards is not available ({e})") from e
    try:
        meta = load_meta(data_dir)
        tokens = load_split(data_dir, "val", meta)
    except FileNotFoundError as e:
        raise ValueError(f"no validation split in data directory {data_dir!r} ({e}); "
                         f"prepare it with data/prepare.py or pass --data_dir") from e
    if eot_token is not None and meta.get("eot_token") != eot_token:
        raise ValueError(f"{data_dir} was prepared with eot_token={meta.get('eot_token')} but the model's "
                         f"eot_token is {eot_token}: wrong data_dir for this checkpoint?")
    return tokens


def heldout_windows(tokens, n_tokens, seq_len):
    """Evenly spaced, non-overlapping windows (n, seq_len) covering the split, about n_tokens in all
    (fewer if the split is shorter). Evenly spaced so every source of an ordered split is sampled."""
    n_total = len(tokens)
    if n_total < seq_len:
        raise ValueError(f"the validation split has {n_total} tokens, fewer than one window of {seq_len}")
    n_rows = max(1, min(math.ceil(n_tokens / seq_len), n_total // seq_len))
    starts = np.linspace(0, n_total - seq_len, n_rows).astype(np.int64)
    rows = np.stack([np.asarray(tokens[s:s + seq_len], dtype=np.int64) for s in starts])
    return torch.from_numpy(rows)


# ----------------------------------------------------------------------------------------------------
# Report: text, JSON, plots


def format_report(result):
    lines = [f"layout={result['layout']} n_layer={result['n_layer']} executed blocks={result['executed_blocks']} "
             f"tokens={result['n_tokens']}"]
    kl = result["kl"]
    lines.append("KL(final || logit lens) per executed block: " + " ".join(fmt(v) for v in kl["curve"]))
    lines.append(f"KL effective depth: {fmt(kl['depth'], 'd')} of {result['executed_blocks']} "
                 f"(peak {kl['peak_kl']:.2f} nats after block {kl['peak']}, threshold {kl['threshold']} nats, "
                 f"status {kl['status']})")
    lines.append("sink mass per executed block (block.visit=mass): " +
                 " ".join(f"{s['block']}.{s['visit']}={fmt(s['mean'])}" for s in result["sink"]))
    a, b = result["visits"]
    if not result["looped"]:
        lines.append(f"visit statistics (visit {b} vs {a}): n/a (no block is executed at both visits)")
        return "\n".join(lines)
    lines.append(f"loop layers {result['loop_layers']}, visit {b} vs visit {a}:")
    lines.append("block  route(rand)   |upd|  |attn| |ffn|  |ffn_in|   X     Q     K     V     PV    O   "
                 "top8 same/other  sink v%d->v%d" % (a, b))
    for layer in result["layers"]:
        n, c = layer["norm_ratio"], layer["cosine"]
        lines.append(f"{layer['block']:5d}  {fmt(layer['routing_overlap']):>5}({fmt(layer['routing_random'])})  "
                     f"{fmt(n['update']):>6} {fmt(n['attn']):>6} {fmt(n['ffn']):>6} {fmt(n['ffn_in']):>6}  "
                     + " ".join(f"{fmt(c[q]):>5}" for q, _ in ATTENTION_QUANTITIES)
                     + f"   {fmt(layer['topk_overlap_same_head'])}/{fmt(layer['topk_overlap_other_head'])}"
                     f"        {fmt(layer['sink_visit_a'])}->{fmt(layer['sink_visit_b'])}")
    lines.append(f"sink mass per head, visit {a} -> visit {b}:")
    for layer in result["layers"]:
        pairs = zip(layer["sink_per_head_visit_a"] or [], layer["sink_per_head_visit_b"] or [])
        lines.append(f"  block {layer['block']}: " + " ".join(f"{fmt(x)}->{fmt(y)}" for x, y in pairs))
    u = result["update_cosine"]
    lines.append(f"update cosine across visits: same layer {fmt(u['same_layer'])}, "
                 f"mismatched layers {fmt(u['mismatched'])}")
    return "\n".join(lines)


def _savefig(fig, path):
    """Write a figure atomically (common.write_atomic: temp file beside it, then rename)."""
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"))


def plot_probes(result, out_dir):
    """Per-head sink heatmaps (loop layers at both visits, or every block of a non-looped model) and the
    KL-by-depth curve. Returns the written paths, or [] with a message if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("probe: matplotlib is not installed; skipping plots (pip install matplotlib)", file=sys.stderr)
        return []
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    a, b = result["visits"]
    if result["looped"]:
        panels = [(f"visit {v}", [s["per_head"] for blk in result["loop_layers"] for s in result["sink"]
                                  if s["block"] == blk and s["visit"] == v], result["loop_layers"]) for v in (a, b)]
    else:
        panels = [("all blocks", [s["per_head"] for s in result["sink"]], [s["block"] for s in result["sink"]])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels) + 1, 3), squeeze=False)
    for ax, (title, rows, labels) in zip(axes[0], panels):
        data = np.array([[np.nan if v is None else v for v in row] for row in rows], dtype=float)
        image = ax.imshow(data, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set(title=f"sink mass, {title}", xlabel="head", ylabel="block")
        ax.set_yticks(range(len(labels)), labels)
        if data.size <= 128:  # small tables: print the mass in each cell
            for (row, col), value in np.ndenumerate(data):
                ax.text(col, row, "" if np.isnan(value) else f"{value:.2f}", ha="center", va="center",
                        fontsize=7, color="white" if value < 0.5 else "black")
        fig.colorbar(image, ax=ax)
    path = os.path.join(out_dir, "sink_heatmap.png")
    _savefig(fig, path)
    plt.close(fig)
    paths.append(path)
    fig, ax = plt.subplots(figsize=(5, 3))
    plot_kl_curves(ax, {result["layout"]: result["kl"]})
    path = os.path.join(out_dir, "kl_depth.png")
    _savefig(fig, path)
    plt.close(fig)
    paths.append(path)
    return paths


def plot_kl_curves(ax, kl_by_label):
    """KL(final || lens) against executed depth for several models on one matplotlib axis; a marker at
    each effective depth. kl_by_label: {label: result["kl"]}."""
    threshold = None
    for label, kl in kl_by_label.items():
        depth = range(1, len(kl["curve"]) + 1)
        line, = ax.plot(depth, kl["curve"], marker=".", label=f"{label} (depth {fmt(kl['depth'], 'd')})")
        if kl["depth"] is not None:
            ax.plot([kl["depth"]], [kl["curve"][kl["depth"] - 1]], "o", color=line.get_color(), fillstyle="none")
        threshold = kl["threshold"]
    if threshold is not None:
        ax.axhline(threshold, color="gray", linestyle="--", linewidth=0.8)
    ax.set(xlabel="executed block", ylabel="KL(final || lens) [nats]", title="logit-lens KL by depth")
    ax.legend(fontsize=7)


# ----------------------------------------------------------------------------------------------------
# CLI


def check_recorded_bytes(cfg, rows, seq_len, n_passes=None):
    """Refuse a probe forward whose recorded attention probabilities would exceed MAX_RECORDED_BYTES."""
    blocks = cfg.executed_layers(n_passes)
    size = rows * cfg.n_head * seq_len ** 2 * 4 * blocks
    if size > MAX_RECORDED_BYTES:
        raise ValueError(f"a probe forward keeps the attention of every executed block: {rows} windows x {cfg.n_head} "
                         f"heads x {seq_len}^2 x 4 bytes x {blocks} blocks = {size / 2**30:.3g} GiB, above "
                         f"{MAX_RECORDED_BYTES / 2**30:.3g} GiB; lower --batch_size or --seq_len")


def main(argv=None):
    parser = common.parser("probe.py", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="checkpoint written by train.py (required)")
    parser.add_argument("--tokens", type=number(int, 1), default=16384,
                        help="held-out tokens to probe, at most the validation split (default: %(default)s)")
    parser.add_argument("--data_dir", default=None,
                        help="override the checkpoint's data_dir (default: the checkpoint's)")
    parser.add_argument("--seq_len", type=number(int, 1), default=None,
                        help="window length, at most block_size (default: block_size)")
    parser.add_argument("--batch_size", type=number(int, 1), default=8,
                        help="windows per forward; their recorded attention must fit in "
                             f"{MAX_RECORDED_BYTES >> 30} GiB (default: %(default)s)")
    visits = number(int, 1, MAX_PASSES, why=f"a block runs once per pass, at most {MAX_PASSES} passes")
    parser.add_argument("--visits", type=visits, nargs=2, default=(1, 2), help="the two visits compared (default: 1 2)")
    parser.add_argument("--n_passes", type=number(int, 1, MAX_PASSES, why=PASSES_WHY), default=None,
                        help=f"override r / K for the probe forward, at most {MAX_PASSES} (default: as trained)")
    parser.add_argument("--attn_topk", type=number(int, 1), default=8,
                        help="attended keys compared per head, at most seq_len // 2 (default: %(default)s)")
    parser.add_argument("--kl_threshold", type=number(float, 0, open_low=True), default=2.0,
                        help="nats, for the KL effective depth (default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device to probe on, e.g. cpu, cuda, cuda:1 (default: cuda when available, "
                             "else cpu)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text (default: text)")
    parser.add_argument("--plot", default=None, metavar="DIR",
                        help="write sink heatmaps and the KL curve here; inside a run folder only while no training "
                             "holds it (default: no plots)")
    args = parser.parse_args(argv)

    try:
        with contextlib.ExitStack() as stack:
            device = resolve_device(args.device)  # one line for an unknown or absent device, before any work
            if args.plot:  # the figures' folder: held if it is (in) a run folder, made before the probes run
                stack.enter_context(rundir.run_folder_held(args.plot, "write the plots elsewhere with --plot"))
                os.makedirs(args.plot, exist_ok=True)
            model, ckpt = load_model(args.ckpt)
            check_n_passes(model.config, args.n_passes)
            data_dir = resolve_data_dir(args.data_dir or ckpt.get("data_dir"))
            seq_len = args.seq_len or model.config.block_size
            if not 1 <= seq_len <= model.config.block_size:
                raise ValueError(f"--seq_len={seq_len} must be in [1, block_size={model.config.block_size}]")
            if args.attn_topk > seq_len // 2:
                raise ValueError(f"--attn_topk {args.attn_topk}: at most seq_len // 2 = {seq_len // 2} (only queries "
                                 "with 2 x attn_topk attendable keys are compared)")
            idx = heldout_windows(load_val_tokens(data_dir, model.config.eot_token), args.tokens, seq_len)
            if int(idx.max()) >= model.config.vocab_size:
                raise ValueError(f"data in {data_dir} has token id {int(idx.max())} >= the model's "
                                 f"vocab_size={model.config.vocab_size}: wrong data_dir for this checkpoint?")
            check_recorded_bytes(model.config, min(args.batch_size, len(idx)), seq_len, args.n_passes)
            model.to(device)
            result = run_probes(model, idx, visits=tuple(args.visits), n_passes=args.n_passes,
                                batch_size=args.batch_size, attn_topk=args.attn_topk, kl_threshold=args.kl_threshold,
                                progress=not args.json)
            result.update(ckpt=args.ckpt, data_dir=data_dir, step=(ckpt.get("state") or {}).get("step"))
            if args.plot:
                result["plots"] = plot_probes(result, args.plot)
    except (ValueError, OSError) as e:
        return cli_error("probe.py", e)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_report(result))
        for path in result.get("plots") or []:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
