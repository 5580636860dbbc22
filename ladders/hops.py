"""Where depth is needed (kind "hops"): k-hop pointer chasing (data/synthetic.py's hops_document), a task
that composes k lookups, k = 1..max_hops, without writing the steps out. At every scale the arms read the
same tokens, each seed once: A the MoE baseline, B the SMELT twin's shape run once, C the SMELT twin (A's
FLOPs, parameters and KV cache), D the baseline looped as SMELT (A's parameters, 1.5x its FLOPs), P the
baseline as prelude-core-coda with a tied core run K times (A's parameters), E a plain baseline as deep as
D executes (D's FLOPs, 1.5x the parameters). After training, the accuracy of every query's answer per k on
held-out documents, at the trained passes and, for the looped arms, at test-time passes beyond them. The
report: accuracy per arm and k with the contrasts' intervals, and the decision rule's reading
(docs/ladder.md, written before the run)."""

import json
import os
import random
from dataclasses import replace

import numpy as np
import torch

import match
from data import synthetic
from data.loader import default_dir, get_tokenizer, read_meta
from ladders.decompose import arms as decompose_arms
from ladders.runs import RunSpec, folder
from ladders.smelt import cells, compute_active, model_settings
from ladders.stats import difference, pooled_std

ARMS = {"A": "the baseline", "B": "the twin's shape, no loop", "C": "the SMELT twin",
        "D": "the baseline looped (r = 2)", "P": "the baseline as prelude-core-coda (K = 2)",
        "E": "the baseline as deep as D runs"}
LOOPED = "CDP"
COLUMNS = ("arm", "cell", "seed", "F", "N_stored", "n_layer", "n_embd", "layout", "lr", "passes", "hops",
           "accuracy", "queries", "loss", "run_id", "seconds")


def data_dir(preset):
    """The task's training documents (seed 0), tokenized once, offline, into data/cache/default-<tokenizer>-
    hops<letters>x<hops>-<documents>."""
    t = preset["task"]
    out = f"{default_dir(preset['tokenizer'])}-hops{t['n_symbols']}x{t['max_hops']}-{t['train_docs']}"
    if not read_meta(out, preset["tokenizer"]):
        from data import prepare
        text = synthetic.hops_corpus_text(t["train_docs"], 0, t["n_symbols"], t["max_hops"])
        os.makedirs(os.path.dirname(out), exist_ok=True)
        path = out + ".jsonl"
        with open(path, "w") as f:
            f.writelines(json.dumps(dict(text=doc)) + "\n" for doc in text)
        prepare.prepare([path], out, preset["tokenizer"], val_fraction=0.02, verbose=False,
                        keep_existing=True)
        os.remove(path)
    return out


def all_arms(base, twin, passes):
    return dict(decompose_arms(base, twin), P=replace(base, layout="pcc", n_passes=passes))


@torch.no_grad()
def accuracy(model, task, n_passes=None, seed=1, batch=64):
    """{k: (correct, queries)} of the greedy answers to every query of task["eval_docs"] held-out documents
    (a seed the training documents never use), one forward per batch of documents."""
    eot, tok = int(model.config.eot_token), get_tokenizer(task["tokenizer"])
    rng = random.Random(f"hops-eval-{seed}")
    docs = [synthetic.hops_document(rng, task["n_symbols"], task["max_hops"])
            for _ in range(task["eval_docs"])]
    out = {}
    for i in range(0, len(docs), batch):
        rows = [[eot] + tok.encode(text) for text, _ in docs[i:i + batch]]  # a byte-level tokenizer: a
        width = max(map(len, rows))  # character per token, so that a query's offset is its token's
        logits = model(torch.tensor([r + [eot] * (width - len(r)) for r in rows]), n_passes=n_passes)[0]
        for r, (_, answers) in enumerate(docs[i:i + batch]):
            for offset, k in answers:  # the answer's token is offset + 1 (the eot first), predicted at offset
                hit = int(logits[r, offset].argmax()) == rows[r][offset + 1]
                c, n = out.get(k, (0, 0))
                out[k] = (c + hit, n + 1)
    return out


def plan(preset, results, train_tokens=None):
    """Every run: per cell, arm and seed one WSD run of preset["steps"] steps (the same tokens for every
    arm), every arm at the preset's one LR."""
    specs, lr = [], preset["lr"]["values"][0]
    for cell, _, base, twin, _ in cells(preset):
        for arm, cfg in all_arms(base, twin, preset["pcc_passes"]).items():
            for seed in preset["seeds"]:
                meta = dict(arm=arm, cell=cell, seed=seed, F=match.flops_per_token(cfg),
                            N=compute_active(base), N_stored=match.accounting(cfg)["params_total"],
                            n_layer=cfg.n_layer, n_embd=cfg.n_embd, layout=cfg.layout, lr=lr, grid_lr=lr,
                            passes=cfg.n_passes)
                specs.append(RunSpec(f"{arm}-{cell}-s{seed}", dict(
                    preset["train"], **model_settings(cfg), seed=seed, max_steps=preset["steps"],
                    eval_interval=preset["steps"], **{preset["lr"]["key"]: lr}), meta))
    return specs, None


def evaluate(preset, specs, results, out):
    """Each finished run's accuracy per k from its checkpoint -> results with "accuracy": {passes: {k:
    (correct, queries)}}, at the trained passes and for a looped arm at 1..test_passes."""
    from model import load_checkpoint
    task = dict(preset["task"], tokenizer=preset["tokenizer"])
    for s in (s for s in specs if s.run_id in results):
        model, _ = load_checkpoint(os.path.join(folder(out, s.run_id), "ckpt.pt"))
        passes = range(1, preset["test_passes"] + 1) if s.meta["arm"] in LOOPED else [s.meta["passes"]]
        results[s.run_id]["accuracy"] = {p: accuracy(model.eval(), task, p) for p in passes}
    return results


def rows(specs, results):
    """runs.csv: a row per finished run, test passes and k (the val loss and seconds: the run's)."""
    out = []
    for s in specs:
        r = results.get(s.run_id)
        for passes, by_k in (r or {}).get("accuracy", {}).items():
            for k, (correct, queries) in sorted(by_k.items()):
                row = dict(s.meta, passes=passes, hops=k, accuracy=correct / queries, queries=queries,
                           loss=r["val_loss"], run_id=s.run_id, seconds=r["seconds"])
                out.append({c: row[c] for c in COLUMNS})
    return out


CONTRASTS = [("C", "A", "SMELT: equal FLOPs, parameters and KV cache"),
             ("D", "A", "the loop: equal stored parameters, 1.5x FLOPs"),
             ("P", "A", "prelude-core-coda: equal stored parameters, 1.5x FLOPs"),
             ("E", "A", "fresh depth: 1.5x FLOPs and parameters"),
             ("D", "E", "the loop vs fresh depth: equal FLOPs"),
             ("P", "E", "prelude-core-coda vs fresh depth: equal FLOPs"),
             ("C", "B", "the loop on the narrow model")]


def trained_passes(preset, arm):
    return preset["pcc_passes"] if arm == "P" else 2 if arm in "CD" else 1


def accuracies(preset, rows, cell):
    """({arm: {k: [accuracy per seed]}} at the trained passes, {arm: {passes: [multi-hop accuracy per
    seed]}}): multi-hop is the mean over k >= 2, each k alike."""
    by_k, multi = {}, {}
    for r in rows:
        if r["cell"] == cell and r["passes"] == trained_passes(preset, r["arm"]):
            by_k.setdefault(r["arm"], {}).setdefault(r["hops"], []).append(r["accuracy"])
        if r["cell"] == cell and r["hops"] >= 2:
            multi.setdefault(r["arm"], {}).setdefault(r["passes"], {}).setdefault(r["seed"], []).append(
                r["accuracy"])
    return by_k, {a: {p: [float(np.mean(v)) for v in seeds.values()] for p, seeds in d.items()}
                  for a, d in multi.items()}


def reading(z, z_test):
    """The decision rule written before the run, on the contrasts' z (difference / its sigma) of multi-hop
    accuracy, and z_test: (trained + 1 passes) - trained of each looped arm."""
    if z["E-A"] <= 2:
        out = ["depth does not pay here (E - A within 2 sigma): the task cannot show where looping pays"]
    elif z["D-A"] > 2 or z["P-A"] > 2:
        fresh = "as much as" if min(z["D-E"], z["P-E"]) >= -2 else "less than"
        out = [f"the second visit pays at equal stored parameters (D - A or P - A above +2 sigma), {fresh} "
               "fresh depth at equal FLOPs"]
    else:
        out = ["depth pays (E - A above +2 sigma) but the loop does not (D - A and P - A within 2 sigma)"]
    smelt = ("gains", "above +2") if z["C-A"] > 2 else ("loses", "below -2") if z["C-A"] < -2 else \
        ("neither gains nor loses", "within 2")
    more = [a for a, v in z_test.items() if v > 2]
    return out + [f"SMELT {smelt[0]} at matched compute (C - A {smelt[1]} sigma)",
                  f"passes beyond the trained ones pay at test time for {', '.join(more)}" if more else
                  "passes beyond the trained ones do not pay at test time (no looped arm above +2 sigma)"]


def report(preset, rows, sweep=None):
    """Per cell: accuracy per arm and k, the contrasts of multi-hop accuracy with their intervals, test-time
    passes, the rule's reading."""
    t, seeds = preset["task"], ", ".join(map(str, preset["seeds"]))
    lines = [f"== {preset['name']}: k-hop pointer chasing ({t['n_symbols']} letters, k = 1..{t['max_hops']}, "
             f"a guess among the letters 1/{t['n_symbols']}); every arm reads the same {preset['steps']} "
             f"steps of tokens, seeds {seeds}; accuracy over {t['eval_docs']} held-out documents",
             "  " + "; ".join(f"{a} {what}" for a, what in ARMS.items())]
    for cell in dict.fromkeys(r["cell"] for r in rows):
        by_k, multi = accuracies(preset, rows, cell)
        trained = {a: multi[a][trained_passes(preset, a)] for a in ARMS}
        sigma, dof = pooled_std(list(trained.values()))
        first = {r["arm"]: r for r in rows if r["cell"] == cell}
        lines += [f"{cell}: accuracy at the trained passes, mean over seeds (multi-hop: k >= 2, each k "
                  "alike)",
                  f"  {'arm':<4} {'F/token':>9} {'stored':>8} {'val loss':>8} " + " ".join(
                      f"{'k=' + str(k):>6}" for k in by_k["A"]) + f" {'multi-hop':>9}"]
        for a in ARMS:
            loss = np.mean([r["loss"] for r in rows if r["cell"] == cell and r["arm"] == a and r["hops"] == 1
                            and r["passes"] == trained_passes(preset, a)])
            lines.append(f"  {a:<4} {first[a]['F']:9.3g} {first[a]['N_stored']:8.0f} {loss:8.4f} " + " ".join(
                f"{np.mean(v):6.3f}" for v in by_k[a].values()) + f" {np.mean(trained[a]):9.3f}")
        lines.append(f"pooled seed std of multi-hop accuracy {sigma:.4f} ({dof} dof); a contrast's interval: "
                     "95% t with it")
        diff = lambda x, y: difference(np.mean(x), len(x), np.mean(y), len(y), sigma, dof)  # noqa: E731
        z = {}
        for x, y, what in CONTRASTS:
            c = diff(trained[x], trained[y])
            z[f"{x}-{y}"] = c["z"]
            lines.append(f"  {x} - {y} ({what}): {c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}] = "
                         f"{c['z']:+.1f} sigma")
        lines.append("test-time passes: multi-hop accuracy, mean over seeds, at 1.. passes; (trained + 1) - "
                     "trained")
        z_test = {}
        for a in LOOPED:
            k = trained_passes(preset, a)
            c = diff(multi[a][k + 1], multi[a][k])
            z_test[a] = c["z"]
            lines.append(f"  {a} (trained at {k}): " + " ".join(f"{p}: {np.mean(v):.3f}" for p, v in
                                                                multi[a].items())
                         + f"; {k + 1} - {k}: {c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]")
        lines += [f"the decision rule's reading ({cell}):"] + ["  " + s for s in reading(z, z_test)]
    return lines


def figures(preset, rows, path, out=None):
    """Per cell: accuracy against k at the trained passes per arm, and multi-hop accuracy against the
    passes run at test time for the looped arms (means over seeds)."""
    import plots
    written = []
    for cell in dict.fromkeys(r["cell"] for r in rows):
        by_k, multi = accuracies(preset, rows, cell)
        curves = lambda d: {f"{a} {ARMS[a]}": [(x, np.mean(v)) for x, v in d[a].items()] for a in d}  # noqa
        panels = [("hops k (at the trained passes)", curves(by_k)),
                  ("passes at test time (multi-hop accuracy)", curves({a: multi[a] for a in LOOPED}))]
        if plots.plot_accuracy_panels(panels, path(f"{cell}-accuracy.png"), f"{preset['name']} {cell}: k-hop "
                                      "pointer chasing", chance=1 / preset["task"]["n_symbols"]):
            written.append(path(f"{cell}-accuracy.png"))
    return written
