"""
What the second visit does: SMELT's mechanistic probes [S §6] and the KL effective depth [X].

    python probe.py --ckpt CKPT --tokens 8192   # the report
    python probe.py --ckpt CKPT --json --plot out/probe   # JSON and two figures

It reads evenly spaced windows of the validation split; forward hooks
record each executed block as (block, visit).
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

# [S10] What attention computes, compared across visits.
ATTENTION_QUANTITIES = (("X", "attn_in"), ("Q", "q"), ("K", "k"), ("V", "v"),
                        ("PV", "attn_context"), ("O", "attn_output"))
# [S §6] The writes whose norms are compared.
WRITES = {"update": "update", "attn": "attn_update", "ffn": "ffn_update", "ffn_in": "ffn_in"}


# -------------------- Statistics: pure functions of tensors


def routing_overlap(ids_a, ids_b):
    # Mean size of the intersection of two top-k expert sets.
    same = ids_a.unsqueeze(-1) == ids_b.unsqueeze(-2)  # (..., k, k)
    return same.any(dim=-1).sum(dim=-1).float().mean().item()


def random_routing_overlap(top_k, n_expert):
    # The expected overlap of independent, uniform top-k sets.
    return top_k * top_k / n_expert


def mean_norm(x):
    return x.float().norm(dim=-1).mean().item()


def norm_ratio(x_b, x_a):
    # A ratio of mean norms, not a mean of ratios, so a few
    # near-zero norms cannot dominate it.
    return mean_norm(x_b) / mean_norm(x_a)


def mean_cosine(x_a, x_b):
    return F.cosine_similarity(x_a.float(), x_b.float(), dim=-1, eps=1e-12).mean().item()


def cross_visit_cosine_matrix(updates_a, updates_b):
    # C[i, j] = mean cosine of layer i's update at visit a and layer
    # j's at visit b; off the diagonal is the mismatched-layer
    # control [S §6].
    rows = [[mean_cosine(a, b) for b in updates_b] for a in updates_a]
    return torch.tensor(rows, dtype=torch.float64)


def same_and_mismatched(matrix):
    # The means on and off the diagonal.
    n, diagonal = matrix.size(0), matrix.diagonal().sum()
    off = ((matrix.sum() - diagonal) / (n * n - n)).item() if n > 1 else None
    return (diagonal / n).item(), off


def document_starts(idx, eot_token):
    # Each token's document start: its eot, or 0 for a document
    # begun before the window.
    positions = torch.arange(idx.size(1), device=idx.device).expand_as(idx)
    at_eot = torch.where(idx == eot_token, positions, torch.zeros_like(positions))
    return at_eot.cummax(dim=1).values


def attendable_keys(starts):
    # The keys a query may attend to under the document mask.
    return torch.arange(starts.size(1), device=starts.device) - starts + 1


def sink_mass(probs, starts):
    # Per head, the attention mass on the query's document start;
    # starts attend only to themselves and are left out.
    B, H, T, _ = probs.shape
    at_start = probs.gather(-1, starts[:, None, :, None].expand(B, H, T, 1)).squeeze(-1)
    keep = starts != torch.arange(T, device=starts.device)
    n = int(keep.sum())
    if not n:
        return torch.full((H,), math.nan), n
    return (at_start.double() * keep[:, None]).sum(dim=(0, 2)) / n, n


def topk_attention_overlap(probs_a, probs_b, n_keys, k=8):
    # M[h, g] = mean |top-k keys of head h at visit a ∩ head g's at
    # visit b| / k, off the diagonal the other-head control. Queries
    # with under 2k keys are left out (their top-k sets overlap).
    valid, H = n_keys >= 2 * k, probs_a.size(1)
    n = int(valid.sum())
    if n == 0:
        return torch.full((H, H), math.nan, dtype=torch.float64), 0
    top_a = probs_a.topk(k, dim=-1).indices.permute(0, 2, 1, 3)[valid]  # (n, H, k)
    top_b = probs_b.topk(k, dim=-1).indices.permute(0, 2, 1, 3)[valid]
    # Head h at visit a against every head at visit b.
    rows = []
    for h in range(H):
        same = top_a[:, h, None, :, None] == top_b[:, :, None, :]
        rows.append(same.any(-1).sum(-1).double().mean(0))
    return torch.stack(rows).cpu() / k, n


def diagonal_and_control(matrix):
    # Per head: the same-head value, and the other heads' mean.
    H, same = matrix.size(0), matrix.diagonal().clone()
    return same, (matrix.sum(dim=1) - same) / (H - 1) if H > 1 else None


def kl_to_final(final_logits, lens_logits):
    # KL(p_final || p_lens) in nats, averaged over tokens.
    log_p = final_logits.float().log_softmax(dim=-1)
    log_q = lens_logits.float().log_softmax(dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).mean().item()


def kl_effective_depth(kl_curve, threshold=2.0):
    # [X] The first block after the peak (first maximum) within
    # threshold nats; kl_curve[i] follows block i + 1.
    # "peak_within_threshold": the curve never left the band.
    peak = max(range(len(kl_curve)), key=lambda i: (kl_curve[i], -i))
    result = dict(depth=None, peak=peak + 1, peak_kl=float(kl_curve[peak]),
                  threshold=threshold)
    after = [i for i in range(peak + 1, len(kl_curve)) if kl_curve[i] <= threshold]
    if not after:
        last = peak == len(kl_curve) - 1
        return dict(result, status="peak_is_last" if last else "never")
    status = "ok" if kl_curve[peak] > threshold else "peak_within_threshold"
    return dict(result, depth=after[0] + 1, status=status)


# -------------------- Looking inside: forward hooks, no probe code in the model


@contextlib.contextmanager
def record_blocks(model):
    # Hooks that record every executed block of one forward, in
    # order. visit counts that block's runs; attn_update and
    # ffn_update are the scaled writes [S8]-[S9].
    records, handles, masks = [], [], []
    index = {id(block): i for i, block in enumerate(model.blocks)}

    def document_mask(gpt, args):
        # The model's own mask, whichever kernel runs.
        idx, cfg = args[0], gpt.config
        docs = document_ids(idx, cfg.eot_token) if cfg.document_mask else torch.zeros_like(idx)
        masks[:] = [attention_mask(docs, docs, 0)]

    def open_record(block, args):
        i = index[id(block)]
        records.append(dict(block=i, visit=1 + sum(r["block"] == i for r in records)))

    def close_record(block, args, output):
        (x, scale, _), r = args, records[-1]
        # Block.forward scales both writes by this.
        s = scale * block.residual_multiplier
        r.update(resid_in=x.detach(),
                 resid_out=output[0].detach(),
                 update=(output[0] - x).detach(),
                 attn_update=scaled(r["attn_output"], s),
                 ffn_update=scaled(r.pop("ffn_output"), s))

    def attention(attn, args, output):
        # SDPA returns neither the softmax nor its product with v, so
        # both are recomputed.
        x, ctx = args
        q, k, v = attn.qkv(x, ctx)
        rep = attn.n_head // attn.n_kv_head
        keys = k.repeat_interleave(rep, dim=1)
        scores = q @ keys.transpose(-2, -1) / math.sqrt(attn.head_dim)
        probs = scores.masked_fill(~masks[0], float("-inf")).softmax(dim=-1)
        context = probs @ v.repeat_interleave(rep, dim=1)
        records[-1].update(q=q.detach(), k=k.detach(), v=v.detach(),
                           attn_probs=probs.detach(),
                           attn_context=context.detach(),
                           attn_output=output.detach())

    def ffn(module, args, output):
        records[-1]["ffn_output"] = output[0].detach()
        if output[1] is not None:
            records[-1]["expert_ids"] = output[1]["expert_ids"].detach()

    def store(key):
        return lambda module, args, output: records[-1].update({key: output.detach()})

    handles.append(model.register_forward_pre_hook(document_mask))
    for block in model.blocks:
        hooks = {block.norm1: store("attn_in"), block.attn: attention,
                 block.norm2: store("ffn_in"), block.ffn: ffn}
        handles.append(block.register_forward_pre_hook(open_record))
        handles.append(block.register_forward_hook(close_record))
        handles += [m.register_forward_hook(hook) for m, hook in hooks.items()]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def logit_lens(model, resid):
    # A residual stream read by the model's final norm and head.
    return scaled(model.lm_head(model.norm_f(resid)), model.config.output_multiplier)


# -------------------- Running the probes


@torch.no_grad()
def run_probes(model, idx, visits=(1, 2), n_passes=None, batch_size=8,
               attn_topk=8, kl_threshold=2.0):
    # Every probe on windows idx (B, T): a JSON-ready dict of
    # token-weighted means.
    model.eval()
    cfg, (a, b), device = model.config, visits, next(model.parameters()).device
    sums, weights = {}, {}

    def add(key, value, weight):
        if weight > 0:
            value = value.double().cpu() if torch.is_tensor(value) else value
            sums[key] = sums.get(key, 0.0) + value * weight
            weights[key] = weights.get(key, 0) + weight

    for start in range(0, idx.size(0), batch_size):
        x = idx[start:start + batch_size].to(device)
        # bf16 on CUDA, as trained.
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
        with record_blocks(model) as records, autocast:
            final_logits, _ = model(x, n_passes=n_passes)
        executed = [(r["block"], r["visit"]) for r in records]
        at = dict(zip(executed, records))
        # The loop layers: blocks executed at both visits.
        layers = [blk for blk, v in executed if v == b and (blk, a) in executed]
        starts, n_tok = document_starts(x, cfg.eot_token), x.numel()
        n_keys = attendable_keys(starts)
        # Every block: the lens KL [X] and the attention mass on the
        # document start (the sink).
        for i, r in enumerate(records):
            lens = logit_lens(model, r["resid_out"])
            add(("kl", i), kl_to_final(final_logits, lens), n_tok)
            add(("sink", i), *sink_mass(r["attn_probs"], starts))
        for blk in layers:
            ra, rb = at[(blk, a)], at[(blk, b)]
            # [S8]-[S9] The mean norm of each write.
            for (v, r), (name, key) in itertools.product(((a, ra), (b, rb)), WRITES.items()):
                add(("norm", blk, v, name), mean_norm(r[key]), n_tok)
            # The overlap of the two visits' top-k experts.
            if "expert_ids" in ra:
                overlap = routing_overlap(ra["expert_ids"], rb["expert_ids"])
                add(("routing", blk), overlap, n_tok)
            # [S10] Cross-visit cosines, and top-k attended keys per head.
            for name, key in ATTENTION_QUANTITIES:
                add(("cos", blk, name), mean_cosine(ra[key], rb[key]), n_tok)
            overlap = topk_attention_overlap(ra["attn_probs"], rb["attn_probs"], n_keys, attn_topk)
            add(("topk", blk), *overlap)
        # Update cosines, same layer vs mismatched layers.
        if layers:
            update = {v: [at[(blk, v)]["update"] for blk in layers] for v in (a, b)}
            add(("update_cos",), cross_visit_cosine_matrix(update[a], update[b]), n_tok)

    def mean(key):
        return sums[key] / weights[key] if key in sums else None

    return summarize(cfg, mean, executed, layers, visits, idx.numel(), attn_topk, kl_threshold)


def finite(t):
    return None if t is None else [None if math.isnan(v) else v for v in t.tolist()]


def mean_of(values):
    values = [v for v in values or [] if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def summarize(cfg, mean, executed, layers, visits, n_tokens, attn_topk, kl_threshold):
    # The accumulated means as a dict of floats, lists and None.
    a, b = visits
    kl_curve = [mean(("kl", i)) for i in range(len(executed))]
    heads = [finite(mean(("sink", i))) for i in range(len(executed))]
    sink = [dict(block=blk, visit=v, per_head=h, mean=mean_of(h))
            for (blk, v), h in zip(executed, heads)]
    kl = dict(curve=kl_curve, **kl_effective_depth(kl_curve, kl_threshold))
    out = dict(layout=cfg.layout, n_layer=cfg.n_layer,
               executed_blocks=len(executed), n_tokens=n_tokens,
               visits=list(visits), attn_topk=attn_topk,
               looped=bool(layers), loop_layers=layers, sink=sink, kl=kl,
               layers=None, summary=None, update_cosine=None)
    if not layers:
        return out
    sink_at, per_layer = {(s["block"], s["visit"]): s for s in sink}, []
    for blk in layers:
        routing = mean(("routing", blk))
        random_routing = None
        if routing is not None:
            random_routing = random_routing_overlap(cfg.top_k, cfg.n_expert)
        # None when no query had 2k attendable keys.
        overlap = mean(("topk", blk))
        same, control = (None, None) if overlap is None else diagonal_and_control(overlap)
        norms = {w: (mean(("norm", blk, b, w)), mean(("norm", blk, a, w))) for w in WRITES}
        sa, sb = sink_at[(blk, a)], sink_at[(blk, b)]
        per_layer.append(dict(
            block=blk, routing_overlap=routing, routing_random=random_routing,
            # A ratio is None where visit a wrote nothing.
            norm_ratio={w: nb / na if na else None for w, (nb, na) in norms.items()},
            cosine={q: mean(("cos", blk, q)) for q, _ in ATTENTION_QUANTITIES},
            topk_overlap_same_head=mean_of(finite(same)),
            topk_overlap_other_head=mean_of(finite(control)),
            topk_overlap_per_head=finite(same),
            sink_visit_a=sa["mean"],
            sink_visit_b=sb["mean"],
            sink_per_head_visit_a=sa["per_head"],
            sink_per_head_visit_b=sb["per_head"]))
    matrix = mean(("update_cos",))
    same_cos, mismatched_cos = same_and_mismatched(matrix)
    summary = dict(update_cosine_same_layer=same_cos,
                   update_cosine_mismatched=mismatched_cos)
    # Each statistic's mean over the loop layers.
    for key, value in per_layer[0].items():
        if isinstance(value, dict):
            summary[key] = {k: mean_of([layer[key][k] for layer in per_layer]) for k in value}
        elif key != "block" and "per_head" not in key:
            summary[key] = mean_of([layer[key] for layer in per_layer])
    update_cosine = dict(matrix=matrix.tolist(), same_layer=same_cos,
                         mismatched=mismatched_cos)
    return dict(out, layers=per_layer, summary=summary, update_cosine=update_cosine)


def heldout_windows(tokens, n_tokens, seq_len):
    # About n_tokens tokens in evenly spaced windows, so every part
    # of an ordered split is sampled.
    n_rows = max(1, min(math.ceil(n_tokens / seq_len), len(tokens) // seq_len))
    starts = np.linspace(0, len(tokens) - seq_len, n_rows).astype(np.int64)
    rows = [np.asarray(tokens[s:s + seq_len], dtype=np.int64) for s in starts]
    return torch.from_numpy(np.stack(rows))


# -------------------- Report and command line


def fmt(value, spec=".2f"):
    return "n/a" if value is None else format(value, spec)


def format_report(result):
    kl, (a, b) = result["kl"], result["visits"]
    lines = [f"layout={result['layout']} n_layer={result['n_layer']} executed "
             f"blocks={result['executed_blocks']} tokens={result['n_tokens']}",
             "KL(final || logit lens) per executed block: " + " ".join(fmt(v) for v in kl["curve"]),
             f"KL effective depth: {fmt(kl['depth'], 'd')} of {result['executed_blocks']} "
             f"(peak {kl['peak_kl']:.2f} nats after block {kl['peak']}, "
             f"threshold {kl['threshold']} nats, status {kl['status']})",
             "sink mass per executed block (block.visit=mass): " +
             " ".join(f"{s['block']}.{s['visit']}={fmt(s['mean'])}" for s in result["sink"])]
    if not result["looped"]:
        lines.append(f"visit statistics (visit {b} vs {a}): n/a "
                     "(no block is executed at both visits)")
        return "\n".join(lines)
    lines += [f"loop layers {result['loop_layers']}, visit {b} vs visit {a}:",
              "block  route(rand)   |upd|  |attn| |ffn|  |ffn_in|   X     Q     K     V     PV    "
              f"O   top8 same/other  sink v{a}->v{b}"]
    for layer in result["layers"]:
        n, c = layer["norm_ratio"], layer["cosine"]
        route = f"{fmt(layer['routing_overlap']):>5}({fmt(layer['routing_random'])})"
        norms = " ".join(f"{fmt(n[w]):>6}" for w in WRITES)
        cosines = " ".join(f"{fmt(c[q]):>5}" for q, _ in ATTENTION_QUANTITIES)
        topk = f"{fmt(layer['topk_overlap_same_head'])}/{fmt(layer['topk_overlap_other_head'])}"
        sink = f"{fmt(layer['sink_visit_a'])}->{fmt(layer['sink_visit_b'])}"
        lines.append(f"{layer['block']:5d}  {route}  {norms}  {cosines}   {topk}        {sink}")
    lines.append(f"sink mass per head, visit {a} -> visit {b}:")
    for layer in result["layers"]:
        pairs = zip(layer["sink_per_head_visit_a"] or [], layer["sink_per_head_visit_b"] or [])
        heads = " ".join(f"{fmt(x)}->{fmt(y)}" for x, y in pairs)
        lines.append(f"  block {layer['block']}: " + heads)
    u = result["update_cosine"]
    lines.append(f"update cosine across visits: same layer {fmt(u['same_layer'])}, "
                 f"mismatched layers {fmt(u['mismatched'])}")
    return "\n".join(lines)


def plot_probes(result, out_dir):
    # The sink mass per head and block, and the KL curve.
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3))
    rows = [[np.nan if v is None else v for v in s["per_head"]] for s in result["sink"]]
    data = np.array(rows, float)
    fig.colorbar(ax.imshow(data, vmin=0, vmax=1, cmap="viridis", aspect="auto"), ax=ax)
    ax.set(title="sink mass", xlabel="head", ylabel="executed block (block.visit)")
    ax.set_yticks(range(len(data)), [f"{s['block']}.{s['visit']}" for s in result["sink"]])
    fig.savefig(os.path.join(out_dir, "sink_heatmap.png"), dpi=120, bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(5, 3))
    kl = result["kl"]
    depth = f"depth {fmt(kl['depth'], 'd')}"
    ax.plot(range(1, len(kl["curve"]) + 1), kl["curve"], marker=".", label=depth)
    ax.axhline(kl["threshold"], color="gray", linestyle="--", linewidth=0.8)
    ax.set(xlabel="executed block", ylabel="KL(final || lens) [nats]",
           title="logit-lens KL by depth")
    ax.legend()
    fig.savefig(os.path.join(out_dir, "kl_depth.png"), dpi=120, bbox_inches="tight")
    plt.close("all")
    return [os.path.join(out_dir, name) for name in ("sink_heatmap.png", "kl_depth.png")]


def main(argv=None):
    p = argparse.ArgumentParser(prog="probe.py", usage=argparse.SUPPRESS,
                                description=__doc__.split("\n\n")[0].strip())
    arg = p.add_argument
    arg("--ckpt", required=True, help="a ckpt.pt or an export folder")
    arg("--tokens", type=int, default=16384, help="validation tokens to probe")
    arg("--data_dir", help="default: the run's")
    arg("--seq_len", type=int, help="window length (default: block_size)")
    arg("--batch_size", type=int, default=8, help="windows per forward")
    arg("--visits", type=int, nargs=2, default=(1, 2), help="the two visits compared")
    arg("--n_passes", type=int, help="test-time passes (default: as trained)")
    arg("--attn_topk", type=int, default=8, help="attended keys compared per head")
    arg("--kl_threshold", type=float, default=2.0, help="nats, for the KL effective depth")
    arg("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    arg("--json", action="store_true", help="one JSON object instead of text")
    arg("--plot", metavar="DIR", help="write sink_heatmap.png and kl_depth.png here (matplotlib)")
    args = p.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install matplotlib")
    try:
        model, info = load_checkpoint(args.ckpt, args.device)
        check_n_passes(model.config, args.n_passes)
        data_dir = args.data_dir
        if data_dir is None:
            data_dir = (info.get("config") or {}).get("data_dir", "")
        data = load_data(data_dir)
    except (OSError, ValueError, RuntimeError) as e:
        # A missing or bad file, or a bad value or --device.
        p.error(str(e).splitlines()[0])
    block_size = model.config.block_size
    seq_len = min(args.seq_len or block_size, block_size, len(data.val))
    if data.meta["tokenizer"] != info["tokenizer"]:
        p.error(f"{data.data_dir} holds {data.meta['tokenizer']} tokens, "
                f"the model reads {info['tokenizer']}")
    windows = heldout_windows(data.val, args.tokens, seq_len)
    result = run_probes(model, windows, tuple(args.visits), args.n_passes, args.batch_size,
                        args.attn_topk, args.kl_threshold)
    result.update(ckpt=args.ckpt, data_dir=data_dir, step=info.get("step"))
    if args.plot:
        result["plots"] = plot_probes(result, args.plot)
    print(json.dumps(result) if args.json else format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
