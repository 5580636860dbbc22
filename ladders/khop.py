"""A depth task tiny models learn (kind "khop", its own training loop): Sanford, Hsu & Telgarsky's k-hop
induction (2024; chsanford/hop-induction-heads). A string of 4 letters, none twice in a row; at every
position the answer takes k hops, each from the letter at the pointer to the position after its last earlier
occurrence ("none" if there is none); the first token says k. Arms: 2 layers, 4, and 2 run as 4 by
prelude-core-coda or SMELT's loop, the steps calibrated on seeds not reported (docs/ladder.md)."""

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

# A sequence of LENGTH tokens: k, then LENGTH - 1 letters. Tokens: the letters 0-3, k = 1..4 as 4-7, "none",
# and the label of the k token's own position.
LETTERS, HOPS, LENGTH = 4, 4, 98
NONE, BLANK = LETTERS + HOPS, LETTERS + HOPS + 1
VOCAB = BLANK + 1
# Sanford et al.'s errors at k = 1..4 (local/errors.json: width 128, 4 heads, no MLP, 100k steps of 32 x 100)
SANFORD = {2: (0.010, 0.140, 0.346, 0.423), 3: (0.003, 0.008, 0.048, 0.150), 4: (0.001, 0.003, 0.005, 0.015)}
LEARNT = 0.05  # the error at or below which an arm has learnt a k
EVAL_SEED = 10 ** 6  # held-out sequences: no training seed is this large
ARMS = {"L2": dict(n_layer=2, layout="plain", n_passes=1), "L4": dict(n_layer=4, layout="plain", n_passes=1),
        "P": dict(n_layer=2, layout="pcc", n_passes=3), "S": dict(n_layer=2, layout="smelt", n_passes=3)}
COLUMNS = ("arm", "seed", "role", "step", "passes", "k", "error", "heuristic", "F", "N_s", "run_id",
           "seconds")


def sequences(seed, step, size, hops=None):
    """(inputs, targets, k) of `size` sequences drawn from (seed, step), each (size, LENGTH)."""
    rng = np.random.default_rng([seed, step])
    x = np.empty((size, LENGTH), dtype=np.int64)
    x[:, 0] = rng.integers(0, LETTERS, size)
    for i in range(1, LENGTH):
        # never the same letter twice in a row: a shift of 1 to 3
        x[:, i] = (x[:, i - 1] + rng.integers(1, LETTERS, size)) % LETTERS
    k = rng.integers(1, HOPS + 1, size) if hops is None else np.full(size, hops)
    # one hop from each position: the position after the last earlier occurrence of its letter, or -1
    rows, last, after = np.arange(size)[:, None], np.full((size, LETTERS), -1), np.empty_like(x)
    for i in range(LENGTH):
        prev = last[rows[:, 0], x[:, i]]
        after[:, i] = np.where(prev >= 0, prev + 1, -1)
        last[rows[:, 0], x[:, i]] = i
    pointer = np.tile(np.arange(LENGTH), (size, 1))
    for h in range(HOPS):
        moved = np.where(pointer >= 0, after[rows, np.maximum(pointer, 0)], -1)
        pointer = np.where(h < k[:, None], moved, pointer)
    answer = np.where(pointer >= 0, x[rows, np.maximum(pointer, 0)], NONE)
    inputs = np.concatenate([LETTERS + k[:, None] - 1, x], axis=1)[:, :-1]
    targets = np.concatenate([np.full((size, 1), BLANK), answer], axis=1)[:, :-1]
    return torch.from_numpy(inputs), torch.from_numpy(targets), k


def heuristic(n_fit=20_000, n_eval=4_000):
    """The best trivial heuristic per k: the error of the most common answer given (the position, its token,
    the token before), fitted on n_fit sequences, read on n_eval others."""
    out = {}
    for k in range(1, HOPS + 1):
        tables = []
        for seed, n in ((EVAL_SEED + 1, n_fit), (EVAL_SEED + 2, n_eval)):
            inputs, targets, _ = sequences(seed, k, n, hops=k)
            where = np.broadcast_to(np.arange(LENGTH), inputs.shape)
            key = np.ravel_multi_index((where, inputs.numpy(), np.roll(inputs.numpy(), 1, axis=1)),
                                       (LENGTH, VOCAB, VOCAB))
            tables.append((key.ravel(), targets.numpy().ravel()))
        counts = np.zeros((LENGTH * VOCAB * VOCAB, VOCAB))
        np.add.at(counts, tables[0], 1)
        out[k] = float(np.mean(counts.argmax(1)[tables[1][0]] != tables[1][1]))
    return out


def config(settings):
    shape = {k: settings[k] for k in ("n_layer", "n_embd", "n_head", "head_dim", "layout", "n_passes")}
    return ModelConfig(vocab_size=VOCAB, eot_token=BLANK, block_size=LENGTH, n_expert=0, document_mask=False,
                       **shape)


@torch.no_grad()
def errors(model, passes=None, n=256):
    """[error at k = 1..HOPS]: the share of positions answered wrong (Sanford's metric), n sequences a k."""
    model.eval()
    out = [float((model(inputs, n_passes=passes)[0].argmax(-1) != targets).float().mean())
           for inputs, targets, _ in (sequences(EVAL_SEED, k, n, hops=k) for k in range(1, HOPS + 1))]
    model.train()
    return out


def train(settings):
    """One run (the ladder's train function): AdamW, a warmup then a constant LR, fresh sequences; the errors
    every eval_every steps (a calibration run stops once k = 1 and 2 are learnt) and at the end at each test
    pass -> a summary with "scores": {"curve": {step: errors}, "passes": {passes: errors}}."""
    torch.manual_seed(settings["seed"])
    cfg, t0 = config(settings), time.time()
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=settings["lr"], betas=(0.9, 0.95), weight_decay=0.0)
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
        if settings["eval_every"] and step % settings["eval_every"] == 0:
            curve[str(step)] = errors(model)
            if settings["stop_when_learnt"] and max(curve[str(step)][:2]) <= LEARNT:
                break
    passes = range(1, settings["test_passes"] + 1) if cfg.layout != "plain" else [cfg.n_passes]
    scores = dict(curve=curve, passes={str(p): errors(model, p) for p in passes})
    tokens = len(losses) * settings["batch_size"] * LENGTH
    return dict(val_loss=float(np.mean(losses[-50:])), train_losses=losses, tokens=tokens, step=len(losses),
                flops=tokens * match.flops_per_token(cfg), seconds=time.time() - t0, scores=scores)


def calibrated_steps(preset, results):
    """The report's budget: the first evaluation at which the 4-layer arm has learnt k = 1 and 2 on every
    calibration seed, x the margin, on the evaluation grid (at most max_steps); None if never."""
    done = [results[f"calibration-L4-s{s}"] for s in preset["calibration_seeds"]]
    if not all("scores" in r for r in done):  # ladder.py --list plans without training: the longest budget
        return preset["max_steps"]
    learnt = [min((int(s) for s, e in r["scores"]["curve"].items() if max(e[:2]) <= LEARNT), default=None)
              for r in done]
    if None in learnt:
        return None
    grid = preset["eval_every"]
    return min(grid * math.ceil(max(learnt) * preset["margin"] / grid), preset["max_steps"])


def plan(preset, results, train_tokens=None):
    """The 4-layer arm on each calibration seed, then every arm on every report seed for the budget."""
    run = dict(preset["train"], lr=preset["lr"]["values"][0], test_passes=preset["test_passes"],
               eval_every=preset["eval_every"])

    def spec(arm, seed, role, steps):
        settings = dict(run, **ARMS[arm], seed=seed, max_steps=steps, stop_when_learnt=role == "calibration")
        cfg = config(settings)
        counts = match.accounting(cfg)
        meta = dict(arm=arm, seed=seed, role=role, N=counts["params_compute_active"], grid_lr=run["lr"],
                    F=counts["flops_per_token"], N_s=counts["params_total"])
        return RunSpec(f"{role}-{arm}-s{seed}", settings, meta)
    specs = [spec("L4", s, "calibration", preset["max_steps"]) for s in preset["calibration_seeds"]]
    if any(s.run_id not in results for s in specs):
        return specs, None
    steps = calibrated_steps(preset, results)
    return specs + [spec(arm, s, "report", steps) for arm in ARMS for s in preset["seeds"] if steps], None


def rows(specs, results):
    """runs.csv: a row per (run, evaluation, k): the calibration curves, each report run at each pass."""
    out, chance = [], heuristic()
    for s in (s for s in specs if s.run_id in results):
        r = results[s.run_id]
        calibration = s.meta["role"] == "calibration"
        for at, errs in (r["scores"]["curve"] if calibration else r["scores"]["passes"]).items():
            for k, e in enumerate(errs, 1):
                where = dict(step=int(at), passes="") if calibration else dict(step=r["step"], passes=at)
                row = dict(s.meta, **where, k=k, error=e, heuristic=chance[k], run_id=s.run_id,
                           seconds=r["seconds"])
                out.append({c: row[c] for c in COLUMNS})
    return out


def reported(rows):
    """The report seeds, at(arm, seed, k, passes) -> error, the k the 4-layer arm learns on every seed."""
    err = {(r["arm"], r["seed"], str(r["passes"]), r["k"]): r["error"] for r in rows if r["role"] == "report"}
    seeds = sorted({s for _, s, _, _ in err})
    at = lambda a, s, k, p=None: err[a, s, p or str(ARMS[a]["n_passes"]), k]  # noqa: E731
    learnt = [k for k in range(1, HOPS + 1) if seeds and all(at("L4", s, k) <= LEARNT for s in seeds)]
    return seeds, at, learnt


def report(preset, rows, sweep=None):
    """The heuristic, the calibration, each arm's error per k beside Sanford's table with the share of seeds
    that learn it, test-time passes, the paired contrasts, the gate and the rule's reading."""
    chance = {r["k"]: r["heuristic"] for r in rows}
    cal, rep = [r for r in rows if r["role"] == "calibration"], [r for r in rows if r["role"] == "report"]
    t, names = preset["train"], preset["arm_names"]
    lines = [f"== {preset['name']}: k-hop induction (Sanford et al. 2024) over {LETTERS} letters, k = "
             f"1..{HOPS}, every position a target, fresh sequences each step; width {t['n_embd']}, "
             f"{t['n_head']} heads of {t['head_dim']}, a dense FFN",
             "error: the share of positions answered wrong; the best trivial heuristic (the most common "
             "answer given the position, its letter and the one before, measured on the generator): "
             + ", ".join(f"k={k} {e:.3f}" for k, e in sorted(chance.items())), f"learnt: error <= {LEARNT}",
             f"calibration (seeds {', '.join(map(str, preset['calibration_seeds']))}, not reported): the "
             f"4-layer arm's error at k = 1 / 2 every {preset['eval_every']} steps"]
    for seed in preset["calibration_seeds"]:
        err = {(r["step"], r["k"]): r["error"] for r in cal if r["seed"] == seed}
        lines.append(f"  seed {seed}: " + " ".join(f"{s}:{err[s, 1]:.2f}/{err[s, 2]:.2f}"
                                                   for s in sorted({s for s, _ in err})))
    if not rep:
        return lines + ["no reading: the 4-layer arm did not learn k = 1 and 2 on every calibration seed "
                        f"within {preset['max_steps']} steps"]
    seeds, at, readable = reported(rows)
    hops = range(1, HOPS + 1)
    lines += [f"report seeds {', '.join(map(str, seeds))}, {rep[0]['step']} steps each (the calibrated "
              "budget): the error per k, the mean over seeds (the share of seeds that learn it)",
              f"  {'':>36} " + " ".join(f"{f'k={k}':>14}" for k in hops)]
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
        return lines + ["no reading: the instrument failed: the 4-layer arm does not learn k = 1 and 2 on "
                        "every report seed"]
    pairs = {(x, y): paired({k: [at(x, s, k) - at(y, s, k) for s in seeds] for k in readable})
             for x, y in (("L2", "L4"), ("L2", "P"), ("L2", "S"), ("P", "L4"), ("S", "L4"))}
    lines.append(f"error contrasts paired by seed at the k the 4-layer arm learns ({readable}), the noise "
                 "pooled over them; 95% t-intervals")
    for (x, y), c in pairs.items():
        lines.append(f"  {x} - {y}: {c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}] ("
                     + ", ".join(f"k={k} {m:+.3f}" for k, m in c["means"].items()) + ")")
    lines += ["gate: the 4-layer arm learns k = 1 and 2 on every report seed", "the decision rule's reading:",
              "  depth " + ("pays" if pairs["L2", "L4"]["lo"] > 0 else "does not pay beyond noise")
              + " (2 layers minus 4 layers)"]
    for a in ("P", "S"):
        shallower, deeper = pairs["L2", a]["lo"] > 0, pairs[a, "L4"]["lo"] > 0
        reading = ("between 2 and 4 layers" if deeper else "as good as 4 layers and better than 2") \
            if shallower else "no better than 2 layers"
        lines.append(f"  {names[a]}: {reading}")
    return lines


def summary(preset, rows, sweep=None):
    """The README figure's rows: 2 layers' error minus each other arm's, paired, at the k the report reads."""
    seeds, at, ks = reported(rows)
    if not {1, 2} <= set(ks):
        return []
    pairs = {a: paired({k: [at("L2", s, k) - at(a, s, k) for s in seeds] for k in ks})
             for a in ("L4", "P", "S")}
    return [(f"{preset['name']}: {preset['arm_names'][a]} vs 2 layers, at k = {ks[0]}-{ks[-1]}", c["diff"],
             c["lo"], c["hi"]) for a, c in pairs.items()]


def figures(preset, rows, path, out=None):
    """Each arm's error per k at its trained passes (the mean over report seeds) beside Sanford et al.'s."""
    rep = [r for r in rows if r["role"] == "report" and str(r["passes"]) == str(ARMS[r["arm"]]["n_passes"])]
    hops = list(range(1, HOPS + 1))
    curves = {f"{preset['arm_names'][a]} here": (hops, [np.mean([r["error"] for r in rep if (r["arm"], r["k"])
                                                                 == (a, k)]) for k in hops]) for a in ARMS}
    curves |= {f"Sanford depth {d} theirs": (hops, list(v)) for d, v in SANFORD.items()}
    title = f"{preset['name']}: k-hop induction, error per k ({len({r['seed'] for r in rep})} seeds)"
    written = rep and plots.plot_loss_curves(curves, path("errors.png"), title, xlabel="k", ylabel="error")
    return [path("errors.png")] if written else []
