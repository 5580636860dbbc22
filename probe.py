"""
What the second visit does: SMELT's mechanistic probes [S §6] and the KL effective depth [X].

    python probe.py --ckpt out/tiny/ckpt.pt --tokens 8192
    python probe.py --ckpt out/tiny/ckpt.pt --json --plot out/probe   # JSON; a sink heatmap, the KL curve

On evenly spaced windows of the run's validation split, forward hooks (record_blocks) record every executed
block, labelled (block, visit). A block executed at visits a and b (default 1 and 2) is a loop layer; for
each: 1. routing overlap of the two visits' top-k experts vs k^2/n for independent routing; 2. visit b / a
ratios of the mean norms of the update, the attention write, the FFN write and the FFN's input [S8]-[S9], and
update cosines same layer vs mismatched layers; 3. cross-visit cosines of X, Q, K, V, PV, O [S10] and the
overlap of each head's top-8 attended keys vs another head's. For every block: 4. the attention mass on the
query's document start (the sink); 5. KL(final || logit lens), and the KL effective depth.
"""
import argparse
import contextlib
import importlib.util
import itertools
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

from data.loader import load_data
from model import attention_mask, document_ids, load_checkpoint, scaled
from sample import check_n_passes

ATTENTION_QUANTITIES = (("X", "attn_in"), ("Q", "q"), ("K", "k"), ("V", "v"), ("PV", "attn_context"),
                        ("O", "attn_output"))
WRITES = {"update": "update", "attn": "attn_update", "ffn": "ffn_update", "ffn_in": "ffn_in"}  # [S §6] norms


# -------------------- Statistics: pure functions of tensors


def routing_overlap(ids_a, ids_b):
    """Mean size of the intersection of two top-k expert sets per token. ids: (..., k) distinct ids."""
    same = ids_a.unsqueeze(-1) == ids_b.unsqueeze(-2)  # (..., k, k)
    return same.any(dim=-1).sum(dim=-1).float().mean().item()


def random_routing_overlap(top_k, n_expert):
    """Expected overlap of two independent uniformly random top-k sets of n experts: k * k / n."""
    return top_k * top_k / n_expert


def mean_norm(x):
    return x.float().norm(dim=-1).mean().item()


def norm_ratio(x_b, x_a):
    """Visit b over visit a: a ratio of mean norms (a few near-zero visit-a norms cannot dominate it)."""
    return mean_norm(x_b) / mean_norm(x_a)


def mean_cosine(x_a, x_b):
    return F.cosine_similarity(x_a.float(), x_b.float(), dim=-1, eps=1e-12).mean().item()


def cross_visit_cosine_matrix(updates_a, updates_b):
    """C[i, j] = mean cosine of layer i's update at visit a and layer j's at visit b: the diagonal is the
    same layer, the rest the mismatched-layer control [S §6]."""
    return torch.tensor([[mean_cosine(a, b) for b in updates_b] for a in updates_a], dtype=torch.float64)


def same_and_mismatched(matrix):
    """(mean of the diagonal, mean off the diagonal or None for a single layer)."""
    n, diagonal = matrix.size(0), matrix.diagonal().sum()
    return (diagonal / n).item(), ((matrix.sum() - diagonal) / (n * n - n)).item() if n > 1 else None


def document_starts(idx, eot_token):
    """(B, T) position of each position's document start: its eot, or 0 (the window's first token plays
    the BOS of a document that began before the window)."""
    positions = torch.arange(idx.size(1), device=idx.device).expand_as(idx)
    return torch.where(idx == eot_token, positions, torch.zeros_like(positions)).cummax(dim=1).values


def attendable_keys(starts):
    """(B, T) keys each query may attend to under the causal document mask."""
    return torch.arange(starts.size(1), device=starts.device) - starts + 1


def sink_mass(probs, starts):
    """Per head (H,), the attention mass on the query's document start, averaged over the queries that are not
    a document start themselves (those attend only to themselves). probs (B, H, T, T) -> (mass, queries)."""
    B, H, T, _ = probs.shape
    at_start = probs.gather(-1, starts[:, None, :, None].expand(B, H, T, 1)).squeeze(-1)  # (B, H, T)
    keep = starts != torch.arange(T, device=starts.device)
    n = int(keep.sum())
    mass = (at_start.double() * keep[:, None]).sum(dim=(0, 2)) / n if n else torch.full((H,), math.nan)
    return mass, n


def topk_attention_overlap(probs_a, probs_b, n_keys, k=8):
    """M[h, g] = mean over queries of |top-k keys of head h at visit a ∩ those of head g at visit b| / k: the
    diagonal is the same head across visits, the rest the other-head control. Only queries with at least 2k
    attendable keys count (fewer make any two top-k sets overlap). n_keys (B, T). -> (M (H, H), queries)."""
    valid, H = n_keys >= 2 * k, probs_a.size(1)
    n = int(valid.sum())
    if n == 0:
        return torch.full((H, H), math.nan, dtype=torch.float64), 0
    top_a = probs_a.topk(k, dim=-1).indices.permute(0, 2, 1, 3)[valid]  # (n, H, k)
    top_b = probs_b.topk(k, dim=-1).indices.permute(0, 2, 1, 3)[valid]
    rows = [(top_a[:, h, None, :, None] == top_b[:, :, None, :]).any(-1).sum(-1).double().mean(0)
            for h in range(H)]  # head h at visit a against every head at visit b
    return torch.stack(rows).cpu() / k, n


def diagonal_and_control(matrix):
    """Per head: the same-head value and the mean over the other heads (None with one head)."""
    H, same = matrix.size(0), matrix.diagonal().clone()
    return same, (matrix.sum(dim=1) - same) / (H - 1) if H > 1 else None


def kl_to_final(final_logits, lens_logits):
    """Mean over tokens of KL(p_final || p_lens) in nats."""
    log_p, log_q = final_logits.float().log_softmax(dim=-1), lens_logits.float().log_softmax(dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).mean().item()


def kl_effective_depth(kl_curve, threshold=2.0):
    """KL effective depth [X]: kl_curve[i] is KL(final || logit lens) after executed block i + 1; the depth is
    the first block after the peak (the first maximum) within threshold nats. status: "ok";
    "peak_within_threshold" (the curve never left the band, e.g. untrained: the number says little);
    "peak_is_last" or "never" (no depth)."""
    peak = max(range(len(kl_curve)), key=lambda i: (kl_curve[i], -i))
    result = dict(depth=None, peak=peak + 1, peak_kl=float(kl_curve[peak]), threshold=threshold)
    after = [i for i in range(peak + 1, len(kl_curve)) if kl_curve[i] <= threshold]
    if not after:
        return dict(result, status="peak_is_last" if peak == len(kl_curve) - 1 else "never")
    status = "ok" if kl_curve[peak] > threshold else "peak_within_threshold"
    return dict(result, depth=after[0] + 1, status=status)


# -------------------- Looking inside: forward hooks, no probe code in the model


@contextlib.contextmanager
def record_blocks(model):
    """Hooks that fill a list with one record per executed block, in order (one `with` per forward): block,
    visit (its count of that block's runs), resid_in, resid_out, update (the difference), attn_in (X), q, k,
    v (rotated), attn_probs and attn_context (softmax and its product with v, recomputed: SDPA gives neither),
    attn_output (O), attn_update and ffn_update (the scaled writes [S8]-[S9]), ffn_in, expert_ids (MoE)."""
    records, handles, masks = [], [], []
    index = {id(block): i for i, block in enumerate(model.blocks)}

    def document_mask(gpt, args):  # the model's own mask, whichever attention kernel runs
        idx, cfg = args[0], gpt.config
        docs = document_ids(idx, cfg.eot_token) if cfg.document_mask else torch.zeros_like(idx)
        masks[:] = [attention_mask(docs, docs, 0)]

    def open_record(block, args):
        i = index[id(block)]
        records.append(dict(block=i, visit=1 + sum(r["block"] == i for r in records)))

    def close_record(block, args, output):
        (x, scale, _), r = args, records[-1]
        s = scale * block.residual_multiplier  # as Block.forward scales both writes
        r.update(resid_in=x.detach(), resid_out=output[0].detach(), update=(output[0] - x).detach(),
                 attn_update=scaled(r["attn_output"], s), ffn_update=scaled(r.pop("ffn_output"), s))

    def attention(attn, args, output):
        x, ctx = args
        q, k, v = attn.qkv(x, ctx)
        rep = attn.n_head // attn.n_kv_head
        scores = q @ k.repeat_interleave(rep, dim=1).transpose(-2, -1) / math.sqrt(attn.head_dim)
        probs = scores.masked_fill(~masks[0], float("-inf")).softmax(dim=-1)
        context = probs @ v.repeat_interleave(rep, dim=1)
        records[-1].update(q=q.detach(), k=k.detach(), v=v.detach(), attn_probs=probs.detach(),
                           attn_context=context.detach(), attn_output=output.detach())

    def ffn(module, args, output):
        records[-1]["ffn_output"] = output[0].detach()
        if output[1] is not None:
            records[-1]["expert_ids"] = output[1]["expert_ids"].detach()

    def store(key):
        return lambda module, args, output: records[-1].update({key: output.detach()})

    handles.append(model.register_forward_pre_hook(document_mask))
    for block in model.blocks:
        hooks = {block.norm1: store("attn_in"), block.attn: attention, block.norm2: store("ffn_in"),
                 block.ffn: ffn}
        handles += [block.register_forward_pre_hook(open_record), block.register_forward_hook(close_record)]
        handles += [module.register_forward_hook(hook) for module, hook in hooks.items()]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def logit_lens(model, resid):
    """A residual stream decoded by the model's own final norm and head (and [X] output multiplier)."""
    return scaled(model.lm_head(model.norm_f(resid)), model.config.output_multiplier)


# -------------------- Running the probes


@torch.no_grad()
def run_probes(model, idx, visits=(1, 2), n_passes=None, batch_size=8, attn_topk=8, kl_threshold=2.0):
    """Every probe on token windows idx (B, T), micro-batch by micro-batch -> a JSON-ready dict. Means are
    token-weighted over all windows."""
    model.eval()
    cfg, (a, b), device = model.config, visits, next(model.parameters()).device
    sums, weights = {}, {}

    def add(key, value, weight):
        if weight > 0:
            value = value.double().cpu() if torch.is_tensor(value) else value
            sums[key], weights[key] = sums.get(key, 0.0) + value * weight, weights.get(key, 0) + weight

    for start in range(0, idx.size(0), batch_size):
        x = idx[start:start + batch_size].to(device)
        with record_blocks(model) as records, torch.autocast(device.type, dtype=torch.bfloat16,
                                                             enabled=device.type == "cuda"):  # as trained
            final_logits, _ = model(x, n_passes=n_passes)
        executed = [(r["block"], r["visit"]) for r in records]
        layers = [blk for blk, v in executed if v == b and (blk, a) in executed]  # the loop layers
        at, starts, n_tok = dict(zip(executed, records)), document_starts(x, cfg.eot_token), x.numel()
        n_keys = attendable_keys(starts)
        for i, r in enumerate(records):  # every executed block: the KL lens [X] and the sink mass
            add(("kl", i), kl_to_final(final_logits, logit_lens(model, r["resid_out"])), n_tok)
            add(("sink", i), *sink_mass(r["attn_probs"], starts))
        for blk in layers:
            ra, rb = at[(blk, a)], at[(blk, b)]
            for (v, r), (name, key) in itertools.product(((a, ra), (b, rb)), WRITES.items()):
                add(("norm", blk, v, name), mean_norm(r[key]), n_tok)
            if "expert_ids" in ra:
                add(("routing", blk), routing_overlap(ra["expert_ids"], rb["expert_ids"]), n_tok)
            for name, key in ATTENTION_QUANTITIES:
                add(("cos", blk, name), mean_cosine(ra[key], rb[key]), n_tok)
            add(("topk", blk), *topk_attention_overlap(ra["attn_probs"], rb["attn_probs"], n_keys, attn_topk))
        if layers:
            update = {v: [at[(blk, v)]["update"] for blk in layers] for v in (a, b)}
            add(("update_cos",), cross_visit_cosine_matrix(update[a], update[b]), n_tok)
    mean = lambda key: sums[key] / weights[key] if key in sums else None  # noqa: E731
    return summarize(cfg, mean, executed, layers, visits, idx.numel(), attn_topk, kl_threshold)


def finite(t):
    return None if t is None else [None if math.isnan(v) else v for v in t.tolist()]


def mean_of(values):
    values = [v for v in values or [] if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def summarize(cfg, mean, executed, layers, visits, n_tokens, attn_topk, kl_threshold):
    """The accumulated means as the report dict (floats, lists and None)."""
    a, b = visits
    kl_curve = [mean(("kl", i)) for i in range(len(executed))]
    heads = [finite(mean(("sink", i))) for i in range(len(executed))]
    sink = [dict(block=blk, visit=v, per_head=h, mean=mean_of(h)) for (blk, v), h in zip(executed, heads)]
    out = dict(layout=cfg.layout, n_layer=cfg.n_layer, executed_blocks=len(executed), n_tokens=n_tokens,
               visits=list(visits), attn_topk=attn_topk, looped=bool(layers), loop_layers=layers, sink=sink,
               kl=dict(curve=kl_curve, **kl_effective_depth(kl_curve, kl_threshold)), layers=None,
               summary=None, update_cosine=None)
    if not layers:
        return out
    sink_at, per_layer = {(s["block"], s["visit"]): s for s in sink}, []
    for blk in layers:
        routing, overlap = mean(("routing", blk)), mean(("topk", blk))  # overlap None: no query had 2k keys
        same, control = diagonal_and_control(overlap) if overlap is not None else (None, None)
        norms = {w: (mean(("norm", blk, b, w)), mean(("norm", blk, a, w))) for w in WRITES}
        per_layer.append(dict(
            block=blk, routing_overlap=routing,
            routing_random=random_routing_overlap(cfg.top_k, cfg.n_expert) if routing is not None else None,
            norm_ratio={w: nb / na if na else None for w, (nb, na) in norms.items()},  # None: visit a wrote 0
            cosine={name: mean(("cos", blk, name)) for name, _ in ATTENTION_QUANTITIES},
            topk_overlap_same_head=mean_of(finite(same)), topk_overlap_other_head=mean_of(finite(control)),
            topk_overlap_per_head=finite(same), sink_visit_a=sink_at[(blk, a)]["mean"],
            sink_visit_b=sink_at[(blk, b)]["mean"], sink_per_head_visit_a=sink_at[(blk, a)]["per_head"],
            sink_per_head_visit_b=sink_at[(blk, b)]["per_head"]))
    same_cos, mismatched_cos = same_and_mismatched(mean(("update_cos",)))
    summary = dict(update_cosine_same_layer=same_cos, update_cosine_mismatched=mismatched_cos)
    for key, value in per_layer[0].items():  # each statistic's mean over the loop layers
        if isinstance(value, dict):
            summary[key] = {k: mean_of([layer[key][k] for layer in per_layer]) for k in value}
        elif key in ("routing_overlap", "routing_random", "topk_overlap_same_head", "topk_overlap_other_head",
                     "sink_visit_a", "sink_visit_b"):
            summary[key] = mean_of([layer[key] for layer in per_layer])
    return dict(out, layers=per_layer, summary=summary, update_cosine=dict(
        matrix=mean(("update_cos",)).tolist(), same_layer=same_cos, mismatched=mismatched_cos))


def heldout_windows(tokens, n_tokens, seq_len):
    """About n_tokens tokens as evenly spaced, non-overlapping windows (n, seq_len) of the split: every part
    of an ordered split is sampled."""
    n_rows = max(1, min(math.ceil(n_tokens / seq_len), len(tokens) // seq_len))
    starts = np.linspace(0, len(tokens) - seq_len, n_rows).astype(np.int64)
    return torch.from_numpy(np.stack([np.asarray(tokens[s:s + seq_len], dtype=np.int64) for s in starts]))


# -------------------- Report and command line


def fmt(value, spec=".2f"):
    return "n/a" if value is None else format(value, spec)


def format_report(result):
    kl, (a, b) = result["kl"], result["visits"]
    lines = [f"layout={result['layout']} n_layer={result['n_layer']} executed "
             f"blocks={result['executed_blocks']} tokens={result['n_tokens']}",
             "KL(final || logit lens) per executed block: " + " ".join(fmt(v) for v in kl["curve"]),
             f"KL effective depth: {fmt(kl['depth'], 'd')} of {result['executed_blocks']} (peak "
             f"{kl['peak_kl']:.2f} nats after block {kl['peak']}, threshold {kl['threshold']} nats, "
             f"status {kl['status']})",
             "sink mass per executed block (block.visit=mass): " +
             " ".join(f"{s['block']}.{s['visit']}={fmt(s['mean'])}" for s in result["sink"])]
    if not result["looped"]:
        lines.append(f"visit statistics (visit {b} vs {a}): n/a (no block is executed at both visits)")
        return "\n".join(lines)
    lines += [f"loop layers {result['loop_layers']}, visit {b} vs visit {a}:",
              "block  route(rand)   |upd|  |attn| |ffn|  |ffn_in|   X     Q     K     V     PV    O   "
              f"top8 same/other  sink v{a}->v{b}"]
    for layer in result["layers"]:
        n, c = layer["norm_ratio"], layer["cosine"]
        route = f"{fmt(layer['routing_overlap']):>5}({fmt(layer['routing_random'])})"
        lines.append(f"{layer['block']:5d}  {route}  "
                     + " ".join(f"{fmt(n[w]):>6}" for w in WRITES) + "  "
                     + " ".join(f"{fmt(c[q]):>5}" for q, _ in ATTENTION_QUANTITIES)
                     + f"   {fmt(layer['topk_overlap_same_head'])}/{fmt(layer['topk_overlap_other_head'])}"
                     f"        {fmt(layer['sink_visit_a'])}->{fmt(layer['sink_visit_b'])}")
    lines.append(f"sink mass per head, visit {a} -> visit {b}:")
    for layer in result["layers"]:
        pairs = zip(layer["sink_per_head_visit_a"] or [], layer["sink_per_head_visit_b"] or [])
        lines.append(f"  block {layer['block']}: " + " ".join(f"{fmt(x)}->{fmt(y)}" for x, y in pairs))
    u = result["update_cosine"]
    lines.append(f"update cosine across visits: same layer {fmt(u['same_layer'])}, mismatched layers "
                 f"{fmt(u['mismatched'])}")
    return "\n".join(lines)


def plot_probes(result, out_dir):
    """sink_heatmap.png (mass per head of every executed block) and kl_depth.png (the logit-lens KL curve)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3))
    data = np.array([[np.nan if v is None else v for v in s["per_head"]] for s in result["sink"]], float)
    fig.colorbar(ax.imshow(data, vmin=0, vmax=1, cmap="viridis", aspect="auto"), ax=ax)
    ax.set(title="sink mass", xlabel="head", ylabel="executed block (block.visit)")
    ax.set_yticks(range(len(data)), [f"{s['block']}.{s['visit']}" for s in result["sink"]])
    fig.savefig(os.path.join(out_dir, "sink_heatmap.png"), dpi=120, bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(5, 3))
    kl = result["kl"]
    ax.plot(range(1, len(kl["curve"]) + 1), kl["curve"], marker=".", label=f"depth {fmt(kl['depth'], 'd')}")
    ax.axhline(kl["threshold"], color="gray", linestyle="--", linewidth=0.8)
    ax.set(xlabel="executed block", ylabel="KL(final || lens) [nats]", title="logit-lens KL by depth")
    ax.legend()
    fig.savefig(os.path.join(out_dir, "kl_depth.png"), dpi=120, bbox_inches="tight")
    plt.close("all")
    return [os.path.join(out_dir, name) for name in ("sink_heatmap.png", "kl_depth.png")]


def main(argv=None):
    p = argparse.ArgumentParser(prog="probe.py", usage=argparse.SUPPRESS,
                                description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--ckpt", required=True, help="a ckpt.pt or an export folder")
    p.add_argument("--tokens", type=int, default=16384, help="validation tokens to probe")
    p.add_argument("--data_dir", default=None, help="default: the run's")
    p.add_argument("--seq_len", type=int, default=None, help="window length (default: block_size)")
    p.add_argument("--batch_size", type=int, default=8, help="windows per forward")
    p.add_argument("--visits", type=int, nargs=2, default=(1, 2), help="the two visits compared")
    p.add_argument("--n_passes", type=int, default=None, help="test-time passes (default: as trained)")
    p.add_argument("--attn_topk", type=int, default=8, help="attended keys compared per head")
    p.add_argument("--kl_threshold", type=float, default=2.0, help="nats, for the KL effective depth")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.add_argument("--plot", metavar="DIR", help="write sink_heatmap.png and kl_depth.png here (matplotlib)")
    args = p.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install matplotlib")
    try:
        model, info = load_checkpoint(args.ckpt, args.device)
        check_n_passes(model.config, args.n_passes)
        data_dir = (info.get("config") or {}).get("data_dir", "") if args.data_dir is None else args.data_dir
        data = load_data(data_dir)
    except (OSError, ValueError, RuntimeError) as e:  # a missing or bad file, a bad value or --device
        p.error(str(e).splitlines()[0])
    seq_len = min(args.seq_len or model.config.block_size, model.config.block_size, len(data.val))
    if data.meta["tokenizer"] != info["tokenizer"]:
        p.error(f"{data.data_dir} holds {data.meta['tokenizer']} tokens, the model reads {info['tokenizer']}")
    windows = heldout_windows(data.val, args.tokens, seq_len)
    result = run_probes(model, windows, tuple(args.visits), args.n_passes,
                        args.batch_size, args.attn_topk, args.kl_threshold)
    result.update(ckpt=args.ckpt, data_dir=data_dir, step=info.get("step"))
    if args.plot:
        result["plots"] = plot_probes(result, args.plot)
    print(json.dumps(result) if args.json else format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
