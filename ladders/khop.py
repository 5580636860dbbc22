"""A depth task tiny models learn (kind "khop", its own training loop): the k-hop
induction of Sanford, Hsu & Telgarsky (2024; chsanford/hop-induction-heads)."""

import math
import time

import numpy as np
import torch
import torch.nn.functional as F

import match
import plots
from ladders.runs import RunSpec
from ladders.stats import paired
from model import GPT, ModelConfig

# A sequence is k, then LENGTH - 1 letters.
# Tokens: the letters 0-3, k = 1..4 as 4-7, "none",
# and the label of the k token's own position.
LETTERS, HOPS, LENGTH = 4, 4, 98
NONE, BLANK = LETTERS + HOPS, LETTERS + HOPS + 1
VOCAB = BLANK + 1
# Sanford et al.'s errors at k = 1..4 (local/errors.json):
# width 128, 4 heads, no MLP, 100k steps of 32 x 100.
SANFORD = {2: (0.010, 0.140, 0.346, 0.423), 3: (0.003, 0.008, 0.048, 0.150),
           4: (0.001, 0.003, 0.005, 0.015)}
# An arm has learnt a k at this error or below.
LEARNT = 0.05
# Held-out sequences:
# no training seed is this large.
EVAL_SEED = 10 ** 6
ARMS = {a: dict(n_layer=n, layout=layout, n_passes=k) for a, n, layout, k in
        [("L2", 2, "plain", 1), ("L4", 4, "plain", 1), ("P", 2, "pcc", 3), ("S", 2, "smelt", 3)]}
COLUMNS = "arm seed role step passes k error heuristic F N_s run_id seconds".split()


def sequences(seed, step, size, hops=None):
    """(inputs, targets, k) of `size` sequences drawn from (seed, step)."""
    # Letters, none twice in a row; the first token
    # says k. Each position's answer takes k hops.
    rng = np.random.default_rng([seed, step])
    x = np.empty((size, LENGTH), dtype=np.int64)
    x[:, 0] = rng.integers(0, LETTERS, size)
    for i in range(1, LENGTH):
        # Never the same letter twice in a row:
        # a shift of 1 to 3.
        x[:, i] = (x[:, i - 1] + rng.integers(1, LETTERS, size)) % LETTERS
    # k per sequence, or fixed for an eval.
    k = rng.integers(1, HOPS + 1, size) if hops is None else np.full(size, hops)
    # One hop from each position: the position after
    # the last earlier occurrence of its letter, or -1.
    rows, last, after = np.arange(size)[:, None], np.full((size, LETTERS), -1), np.empty_like(x)
    # after[:, i]: where the pointer goes from i.
    for i in range(LENGTH):
        prev = last[rows[:, 0], x[:, i]]
        after[:, i] = np.where(prev >= 0, prev + 1, -1)
        last[rows[:, 0], x[:, i]] = i
    # Hop k times from every position at once.
    pointer = np.tile(np.arange(LENGTH), (size, 1))
    for h in range(HOPS):
        moved = np.where(pointer >= 0, after[rows, np.maximum(pointer, 0)], -1)
        pointer = np.where(h < k[:, None], moved, pointer)
    answer = np.where(pointer >= 0, x[rows, np.maximum(pointer, 0)], NONE)
    # Prepend k; a target is the next answer.
    inputs = np.concatenate([LETTERS + k[:, None] - 1, x], axis=1)[:, :-1]
    targets = np.concatenate([np.full((size, 1), BLANK), answer], axis=1)[:, :-1]
    return torch.from_numpy(inputs), torch.from_numpy(targets), k


def heuristic(n_fit=20_000, n_eval=4_000):
    """The best trivial heuristic's error per k."""
    # The most common answer given the position, its
    # token and the one before.
    out = {}
    for k in range(1, HOPS + 1):
        tables = []
        for seed, n in ((EVAL_SEED + 1, n_fit), (EVAL_SEED + 2, n_eval)):
            inputs, targets, _ = sequences(seed, k, n, hops=k)
            where = np.broadcast_to(np.arange(LENGTH), inputs.shape)
            key = np.ravel_multi_index((where, inputs.numpy(), np.roll(inputs.numpy(), 1, axis=1)),
                                       (LENGTH, VOCAB, VOCAB))
            tables.append((key.ravel(), targets.numpy().ravel()))
        # The most common answer per key, on the fit set.
        counts = np.zeros((LENGTH * VOCAB * VOCAB, VOCAB))
        np.add.at(counts, tables[0], 1)
        out[k] = float(np.mean(counts.argmax(1)[tables[1][0]] != tables[1][1]))
    return out


def config(settings):
    keys = ("n_layer", "n_embd", "n_head", "head_dim", "layout", "n_passes")
    shape = {k: settings[k] for k in keys}
    return ModelConfig(vocab_size=VOCAB, eot_token=BLANK, block_size=LENGTH, n_expert=0,
                       document_mask=False, **shape)


@torch.no_grad()
def errors(model, passes=None, n=256):
    """[error at k = 1..HOPS]: the share of positions answered wrong."""
    # The same held-out sequences for every model.
    model.eval()
    held_out = (sequences(EVAL_SEED, k, n, hops=k) for k in range(1, HOPS + 1))
    out = [float((model(inputs, n_passes=passes)[0].argmax(-1) != targets).float().mean())
           for inputs, targets, _ in held_out]
    model.train()
    return out


def train(settings):
    """One run (the ladder's train function) -> its summary."""
    # AdamW, a warmup then a constant LR, fresh
    # sequences each step.
    torch.manual_seed(settings["seed"])
    cfg, t0 = config(settings), time.time()
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=settings["lr"], betas=(0.9, 0.95),
                            weight_decay=0.0)
    curve, losses = {}, []
    for step in range(1, settings["max_steps"] + 1):
        for group in opt.param_groups:
            group["lr"] = settings["lr"] * min(1.0, step / settings["warmup_steps"])
        inputs, targets, _ = sequences(settings["seed"], step - 1, settings["batch_size"])
        loss = F.cross_entropy(model(inputs)[0].flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        # A calibration run stops once k = 1 and 2 are learnt.
        if settings["eval_every"] and step % settings["eval_every"] == 0:
            curve[str(step)] = errors(model)
            if settings["stop_when_learnt"] and max(curve[str(step)][:2]) <= LEARNT:
                break
    # A looped arm is also read at other passes.
    passes = range(1, settings["test_passes"] + 1) if cfg.layout != "plain" else [cfg.n_passes]
    scores = dict(curve=curve, passes={str(p): errors(model, p) for p in passes})
    # The val loss: the mean of the last 50 steps.
    tokens = len(losses) * settings["batch_size"] * LENGTH
    return dict(val_loss=float(np.mean(losses[-50:])), train_losses=losses, tokens=tokens,
                step=len(losses), flops=tokens * match.flops_per_token(cfg),
                seconds=time.time() - t0, scores=scores)


def calibrated_steps(preset, results):
    """The report's budget, or None if the 4-layer arm never learns."""
    done = [results[f"calibration-L4-s{s}"] for s in preset["calibration_seeds"]]
    # ladder.py --list plans without training:
    # the longest budget.
    if not all("scores" in r for r in done):
        return preset["max_steps"]
    # The first eval step at which k = 1 and 2 are learnt.
    learnt = [min((int(s) for s, e in r["scores"]["curve"].items() if max(e[:2]) <= LEARNT),
                  default=None) for r in done]
    if None in learnt:
        return None
    # When every calibration seed has learnt, x the
    # margin, on the eval grid.
    grid = preset["eval_every"]
    return min(grid * math.ceil(max(learnt) * preset["margin"] / grid), preset["max_steps"])


def plan(preset, results, train_tokens=None):
    """Calibration runs, then every arm on every report seed."""
    run = dict(preset["train"], lr=preset["lr"]["values"][0], test_passes=preset["test_passes"],
               eval_every=preset["eval_every"])

    def spec(arm, seed, role, steps):
        settings = dict(run, **ARMS[arm], seed=seed, max_steps=steps,
                        stop_when_learnt=role == "calibration")
        counts = match.accounting(config(settings))
        meta = dict(arm=arm, seed=seed, role=role, N=counts["params_compute_active"],
                    grid_lr=run["lr"], F=counts["flops_per_token"], N_s=counts["params_total"])
        return RunSpec(f"{role}-{arm}-s{seed}", settings, meta)
    # The 4-layer arm calibrates the budget.
    specs = [spec("L4", s, "calibration", preset["max_steps"]) for s in preset["calibration_seeds"]]
    if any(s.run_id not in results for s in specs):
        return specs, None
    steps = calibrated_steps(preset, results)
    return specs + [spec(arm, s, "report", steps) for arm in ARMS for s in preset["seeds"]
                    if steps], None


def rows(specs, results):
    """runs.csv: a row per (run, eval, k)."""
    out, chance = [], heuristic()
    for s in (s for s in specs if s.run_id in results):
        r = results[s.run_id]
        # A calibration run keeps its curve,
        # a report run its passes.
        calibration = s.meta["role"] == "calibration"
        for at, errs in (r["scores"]["curve" if calibration else "passes"]).items():
            for k, e in enumerate(errs, 1):
                step, passes = (int(at), "") if calibration else (r["step"], at)
                row = dict(s.meta, step=step, passes=passes, k=k, error=e, heuristic=chance[k],
                           run_id=s.run_id, seconds=r["seconds"])
                out.append({c: row[c] for c in COLUMNS})
    return out


def reported(rows):
    """(report seeds, at(arm, seed, k, passes) -> error, k learnt)."""
    err = {(r["arm"], r["seed"], str(r["passes"]), r["k"]): r["error"]
           for r in rows if r["role"] == "report"}
    seeds = sorted({s for _, s, _, _ in err})
    def at(a, s, k, p=None):
        return err[a, s, p or str(ARMS[a]["n_passes"]), k]
    ks = [k for k in range(1, HOPS + 1) if seeds and all(at("L4", s, k) <= LEARNT for s in seeds)]
    return seeds, at, ks


def report(preset, rows, sweep=None):
    # The heuristic, then the calibration.
    chance = {r["k"]: r["heuristic"] for r in rows}
    cal = [r for r in rows if r["role"] == "calibration"]
    rep = [r for r in rows if r["role"] == "report"]
    t, names = preset["train"], preset["arm_names"]
    lines = [f"== {preset['name']}: k-hop induction (Sanford et al. 2024) over {LETTERS} "
             f"letters, k = 1..{HOPS}, every position a target, fresh sequences each step; "
             f"width {t['n_embd']}, {t['n_head']} heads of {t['head_dim']}, a dense FFN",
             "error: the share of positions answered wrong; the best trivial heuristic (the "
             "most common answer given the position, its letter and the one before, measured "
             "on the generator): " + ", ".join(f"k={k} {e:.3f}" for k, e in sorted(chance.items())),
             f"learnt: error <= {LEARNT}",
             f"calibration (seeds {', '.join(map(str, preset['calibration_seeds']))}, not "
             f"reported): the 4-layer arm's error at k = 1 / 2 every {preset['eval_every']} steps"]
    for seed in preset["calibration_seeds"]:
        err = {(r["step"], r["k"]): r["error"] for r in cal if r["seed"] == seed}
        lines.append(f"  seed {seed}: " + " ".join(f"{s}:{err[s, 1]:.2f}/{err[s, 2]:.2f}"
                                                   for s in sorted({s for s, _ in err})))
    if not rep:
        return lines + ["no reading: the 4-layer arm did not learn k = 1 and 2 on every "
                        f"calibration seed within {preset['max_steps']} steps"]
    # Each arm's error per k, beside Sanford's.
    seeds, at, readable = reported(rows)
    hops = range(1, HOPS + 1)
    lines += [f"report seeds {', '.join(map(str, seeds))}, {rep[0]['step']} steps each (the "
              "calibrated budget): the error per k, the mean over seeds (the share of seeds "
              "that learn it)", f"  {'':>36} " + " ".join(f"{f'k={k}':>14}" for k in hops)]
    for a in ARMS:
        cells = []
        for k in hops:
            errs = [at(a, s, k) for s in seeds]
            cells.append(f"{np.mean(errs):7.3f} ({np.mean([e <= LEARNT for e in errs]):.2f})")
        lines.append(f"  {f'{a} ({names[a]})':>36} " + " ".join(cells))
    for d, v in SANFORD.items():
        lines.append(f"  {f'Sanford depth {d}':>36} " + " ".join(f"{e:7.3f}       " for e in v))
    lines.append("test-time passes (trained: 3): the error per k, the mean over seeds")
    for a in ("P", "S"):
        for p in range(1, preset["test_passes"] + 1):
            lines.append(f"  {a} at {p} passes: " + " ".join(
                f"k={k} {np.mean([at(a, s, k, str(p)) for s in seeds]):.3f}" for k in hops))
    if not {1, 2} <= set(readable):
        return lines + ["no reading: the instrument failed: the 4-layer arm does not learn "
                        "k = 1 and 2 on every report seed"]
    # Contrasts only at the k the 4-layer arm learns.
    pairs = {(x, y): paired({k: [at(x, s, k) - at(y, s, k) for s in seeds] for k in readable})
             for x, y in (("L2", "L4"), ("L2", "P"), ("L2", "S"), ("P", "L4"), ("S", "L4"))}
    lines.append("error contrasts paired by seed at the k the 4-layer arm learns "
                 f"({readable}), the noise pooled over them; 95% t-intervals")
    for (x, y), c in pairs.items():
        lines.append(f"  {x} - {y}: {c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}] ("
                     + ", ".join(f"k={k} {m:+.3f}" for k, m in c["means"].items()) + ")")
    # The gate, then the rule's reading.
    depth = "pays" if pairs["L2", "L4"]["lo"] > 0 else "does not pay beyond noise"
    lines += ["gate: the 4-layer arm learns k = 1 and 2 on every report seed",
              "the decision rule's reading:", f"  depth {depth} (2 layers minus 4 layers)"]
    for a in ("P", "S"):
        shallower, deeper = pairs["L2", a]["lo"] > 0, pairs[a, "L4"]["lo"] > 0
        reading = ("no better than 2 layers" if not shallower else "between 2 and 4 layers"
                   if deeper else "as good as 4 layers and better than 2")
        lines.append(f"  {names[a]}: {reading}")
    return lines


def summary(preset, rows, sweep=None):
    """The README figure's rows: 2 layers minus each arm."""
    seeds, at, ks = reported(rows)
    if not {1, 2} <= set(ks):
        return []
    pairs = {a: paired({k: [at("L2", s, k) - at(a, s, k) for s in seeds] for k in ks})
             for a in ("L4", "P", "S")}
    return [(f"{preset['name']}: {preset['arm_names'][a]} vs 2 layers, at k = {ks[0]}-{ks[-1]}",
             c["diff"], c["lo"], c["hi"]) for a, c in pairs.items()]


def figures(preset, rows, path, out=None):
    """Each arm's error per k, beside Sanford et al.'s."""
    seeds, at, _ = reported(rows)
    hops = list(range(1, HOPS + 1))
    curves = {f"{preset['arm_names'][a]} here": (hops, [np.mean([at(a, s, k) for s in seeds])
                                                         for k in hops]) for a in ARMS}
    curves |= {f"Sanford depth {d} theirs": (hops, list(v)) for d, v in SANFORD.items()}
    title = f"{preset['name']}: k-hop induction, error per k ({len(seeds)} seeds)"
    written = seeds and plots.plot_loss_curves(curves, path("errors.png"), title, xlabel="k",
                                               ylabel="error")
    return [path("errors.png")] if written else []
