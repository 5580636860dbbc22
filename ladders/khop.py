"""A depth task tiny models learn (kind "khop"): Sanford, Hsu & Telgarsky's k-hop induction (2024, "Transformers,
parallel computation, and logarithmic depth"; code chsanford/hop-induction-heads). A string of 4 letters with no
letter twice in a row; at every position the answer is found by k hops, each hop moving from the letter at the
pointer to the position after that letter's last earlier occurrence (the pointer starts at the position
itself); "none" when a hop finds no earlier occurrence. The first token says k; every position is a target;
each step's sequences are drawn from (seed, step), fresh. Arms at one width: 2 layers, 4 layers, and 2 stored
layers executed as 4, by prelude-core-coda ([X]: 1 core block run 3 times, then the coda) and by SMELT's loop
(the first layer run 3 times, updates scaled by 1/3). The step budget is calibrated on seeds not reported; the
report: each arm's error per k beside Sanford's table, the share of seeds that learn each k, test-time passes,
the contrasts paired by seed, the gate and the reading of the rule written before the run (docs/ladder.md)."""

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

LETTERS, HOPS, LENGTH = 4, 4, 98  # a sequence: the k token, then 98 letters (Sanford: 100, the last 2 cut)
NONE, BLANK = LETTERS + HOPS, LETTERS + HOPS + 1  # tokens: letters 0-3, k = 1..4 as 4-7, none, the k token's label
VOCAB = BLANK + 1
# Sanford et al.'s errors at k = 1..4 (local/errors.json; width 128, 4 heads, no MLP, 100k steps of 32 x 100)
SANFORD = {2: (0.010, 0.140, 0.346, 0.423), 3: (0.003, 0.008, 0.048, 0.150), 4: (0.001, 0.003, 0.005, 0.015)}
LEARNT = 0.05  # error at or below which an arm has learnt a k
EVAL_SEED = 10 ** 6  # the held-out sequences' seed (training seeds are small), per k its step
COLUMNS = ("arm", "seed", "role", "step", "passes", "k", "error", "heuristic", "F", "N_s", "run_id", "seconds")


def sequences(seed, step, size, hops=None):
    """(inputs, targets, k) of `size` sequences drawn from (seed, step): int64 tensors (size, 1 + LENGTH)."""
    rng = np.random.default_rng([seed, step])
    x = np.empty((size, LENGTH), dtype=np.int64)
    x[:, 0] = rng.integers(0, LETTERS, size)
    for i in range(1, LENGTH):  # never the same letter twice in a row: a shift of 1..3
        x[:, i] = (x[:, i - 1] + rng.integers(1, LETTERS, size)) % LETTERS
    k = rng.integers(1, HOPS + 1, size) if hops is None else np.full(size, hops)
    rows, last = np.arange(size)[:, None], np.full((size, LETTERS), -1)
    after = np.empty_like(x)  # one hop: the position after the last earlier occurrence of the letter, or -1
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
    """The best trivial heuristic, measured on the generator: per k, the error of the most common answer given
    (position, the letter there, the letter before), fitted on n_fit sequences and read on n_eval others."""
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
    return ModelConfig(vocab_size=VOCAB, eot_token=BLANK, block_size=LENGTH, n_expert=0, document_mask=False,
                       **{k: settings[k] for k in ("n_layer", "n_embd", "n_head", "head_dim", "layout", "n_passes")})


@torch.no_grad()
def errors(model, passes=None, n=256, seed=EVAL_SEED):
    """{k: error}: the share of positions whose greedy answer is wrong (Sanford's metric), over n sequences
    per k drawn from a seed no training step uses."""
    model.eval()
    out = {}
    for k in range(1, HOPS + 1):
        inputs, targets, _ = sequences(seed, k, n, hops=k)
        out[k] = float((model(inputs, n_passes=passes)[0].argmax(-1) != targets).float().mean())
    model.train()
    return out


def train(settings):
    """One run (the ladder's train function): AdamW from settings["seed"]'s draws on fresh sequences, warmup
    then a constant LR; the errors every eval_every steps (a calibration run stops once k = 1 and 2 are learnt)
    and at the end at every test pass -> a summary with "scores"."""
    torch.manual_seed(settings["seed"])
    cfg, t0 = config(settings), time.time()
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=settings["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    curve, losses, step = {}, [], 0
    while step < settings["max_steps"]:
        for group in opt.param_groups:
            group["lr"] = settings["lr"] * min(1.0, (step + 1) / settings["warmup_steps"])
        inputs, targets, _ = sequences(settings["seed"], step, settings["batch_size"])
        loss = F.cross_entropy(model(inputs)[0].flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
        if settings["eval_every"] and step % settings["eval_every"] == 0:
            curve[step] = errors(model)
            if settings["stop_when_learnt"] and max(curve[step][1], curve[step][2]) <= LEARNT:
                break
    passes = range(1, settings["test_passes"] + 1) if cfg.layout != "plain" else [None]
    scores = dict(curve=curve, passes={p or cfg.n_passes: errors(model, p) for p in passes})
    tokens = step * settings["batch_size"] * LENGTH
    return dict(val_loss=float(np.mean(losses[-50:])), train_losses=losses, tokens=tokens, step=step,
                flops=tokens * match.flops_per_token(cfg), seconds=time.time() - t0, scores=scores)


ARMS = {"L2": dict(n_layer=2, layout="plain", n_passes=1), "L4": dict(n_layer=4, layout="plain", n_passes=1),
        "P": dict(n_layer=2, layout="pcc", n_passes=3), "S": dict(n_layer=2, layout="smelt", n_passes=3)}


def calibrated_steps(preset, results):
    """The report's step budget: the first evaluation at which the 4-layer arm has learnt k = 1 and k = 2 on
    every calibration seed, times the preset's margin (at most max_steps); None if it never does."""
    done = [results[f"calibration-L4-s{s}"] for s in preset["calibration_seeds"]]
    if not all("scores" in r for r in done):  # ladder.py --list plans without training: the longest budget
        return preset["max_steps"]
    curves = [r["scores"]["curve"] for r in done]
    learnt = [min((int(s) for s, e in c.items() if max(e["1"], e["2"]) <= LEARNT), default=None)
              for c in (json_keys(c) for c in curves)]
    if None in learnt:
        return None
    step = preset["eval_every"] * math.ceil(max(learnt) * preset["margin"] / preset["eval_every"])
    return min(step, preset["max_steps"])


def json_keys(curve):
    """A curve as JSON gives it back: {"step": {"k": error}} (result.json's keys are strings)."""
    return {str(s): {str(k): v for k, v in e.items()} for s, e in curve.items()}


def plan(preset, results, train_tokens=None):
    """The 4-layer arm on each calibration seed (stopping once it has learnt k = 1 and 2, at most max_steps),
    then every arm on every report seed for the calibrated budget."""
    run = dict(preset["train"], lr=preset["lr"]["values"][0], test_passes=preset["test_passes"],
               eval_every=preset["eval_every"])

    def spec(arm, seed, role, steps, stop):
        settings = dict(run, **ARMS[arm], seed=seed, max_steps=steps, stop_when_learnt=stop)
        cfg = config(settings)
        return RunSpec(f"{role}-{arm}-s{seed}", settings, dict(arm=arm, seed=seed, role=role, N=1, grid_lr=run["lr"],
                       F=match.flops_per_token(cfg), N_s=match.accounting(cfg)["params_total"]))
    specs = [spec("L4", s, "calibration", preset["max_steps"], True) for s in preset["calibration_seeds"]]
    if any(s.run_id not in results for s in specs):
        return specs, None
    steps = calibrated_steps(preset, results)
    if steps:
        specs += [spec(arm, s, "report", steps, False) for arm in ARMS for s in preset["seeds"]]
    return specs, None


def rows(specs, results):
    """runs.csv: a row per (run, evaluation, k): the calibration curves, and every arm's final errors at each
    pass it was read at."""
    out, chance = [], heuristic()
    for s in specs:
        r = results.get(s.run_id)
        if not r:
            continue
        scores = json_keys(r["scores"]["curve"]) if s.meta["role"] == "calibration" else \
            {str(r["step"]): None}
        for step, errs in scores.items():
            for passes, by_k in ({"": errs}.items() if errs else json_keys(r["scores"]["passes"]).items()):
                for k, e in by_k.items():
                    row = dict(s.meta, step=int(step), passes=passes, k=int(k), error=e, heuristic=chance[int(k)],
                               run_id=s.run_id, seconds=r["seconds"])
                    out.append({c: row[c] for c in COLUMNS})
    return out


def report(preset, rows, sweep=None):
    """The heuristic's error, the calibration, each arm's error per k (the mean over seeds) beside Sanford's
    table with the share of seeds that learn it, test-time passes, the contrasts paired by seed at every k the
    4-layer arm learns, the gate and the rule's reading."""
    chance = {r["k"]: r["heuristic"] for r in rows}
    cal, rep = [r for r in rows if r["role"] == "calibration"], [r for r in rows if r["role"] == "report"]
    lines = [f"== {preset['name']}: k-hop induction (Sanford et al. 2024) over {LETTERS} letters, k = 1..{HOPS}, "
             f"every position a target, fresh sequences each step; width {preset['train']['n_embd']}, "
             f"{preset['train']['n_head']} heads of {preset['train']['head_dim']}, a dense FFN",
             "error: the share of positions answered wrong; the best trivial heuristic (the most common answer "
             "given the position, its letter and the one before, measured on the generator): " + ", ".join(
                 f"k={k} {e:.3f}" for k, e in sorted(chance.items())), f"learnt: error <= {LEARNT}",
             f"calibration (seeds {', '.join(map(str, preset['calibration_seeds']))}, not reported): the 4-layer "
             f"arm's error at k = 1 / 2 every {preset['eval_every']} steps"]
    for seed in preset["calibration_seeds"]:
        at = sorted({r["step"] for r in cal if r["seed"] == seed})
        err = {(r["step"], r["k"]): r["error"] for r in cal if r["seed"] == seed}
        lines.append(f"  seed {seed}: " + " ".join(f"{s}:{err[s, 1]:.2f}/{err[s, 2]:.2f}" for s in at))
    if not rep:
        return lines + [f"no reading: the 4-layer arm did not learn k = 1 and 2 on every calibration seed within "
                        f"{preset['max_steps']} steps"]
    seeds, steps = sorted({r["seed"] for r in rep}), rep[0]["step"]
    trained = {a: str(ARMS[a]["n_passes"]) for a in ARMS}
    err = {(r["arm"], r["seed"], str(r["passes"]), r["k"]): r["error"] for r in rep}
    at = lambda a, s, k, p=None: err[a, s, p or trained[a], k]  # noqa: E731
    lines += [f"report seeds {', '.join(map(str, seeds))}, {steps} steps each (the calibrated budget): the error "
              "per k, the mean over seeds (the share of seeds that learn it)",
              f"  {'':>22} " + " ".join(f"{f'k={k}':>14}" for k in range(1, HOPS + 1))]
    for a in ARMS:
        lines.append(f"  {a + ' (' + str(preset['arm_names'][a]) + ')':>22} " + " ".join(
            f"{np.mean([at(a, s, k) for s in seeds]):7.3f} ({np.mean([at(a, s, k) <= LEARNT for s in seeds]):.2f})"
            for k in range(1, HOPS + 1)))
    lines += [f"  {f'Sanford depth {d}':>22} " + " ".join(f"{e:7.3f}       " for e in v) for d, v in SANFORD.items()]
    lines.append("test-time passes (trained: 3): the error per k, the mean over seeds")
    for a in ("P", "S"):
        lines += [f"  {a} at {p} passes: " + " ".join(f"k={k} {np.mean([at(a, s, k, str(p)) for s in seeds]):.3f}"
                                                     for k in range(1, HOPS + 1))
                  for p in range(1, preset["test_passes"] + 1)]
    readable = [k for k in range(1, HOPS + 1) if all(at("L4", s, k) <= LEARNT for s in seeds)]
    if not {1, 2} <= set(readable):
        return lines + ["no reading: the instrument failed: the 4-layer arm does not learn k = 1 and 2 on every "
                        "report seed"]
    pairs = {(x, y): paired({k: [at(x, s, k) - at(y, s, k) for s in seeds] for k in readable})
             for x, y in (("L2", "L4"), ("L2", "P"), ("L2", "S"), ("P", "L4"), ("S", "L4"))}
    lines.append(f"error contrasts paired by seed at the k the 4-layer arm learns ({readable}), the noise pooled "
                 "over them; 95% t-intervals")
    for (x, y), c in pairs.items():
        lines.append(f"  {x} - {y}: {c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}] (" + ", ".join(
            f"k={k} {m:+.3f}" for k, m in c["means"].items()) + ")")
    lines += ["gate: the 4-layer arm learns k = 1 and 2 on every report seed", "the decision rule's reading:",
              "  depth " + ("pays" if pairs["L2", "L4"]["lo"] > 0 else "does not pay beyond noise")
              + " (2 layers minus 4 layers)"]
    for a in ("P", "S"):
        above_shallow, below_deep = pairs["L2", a]["lo"] > 0, pairs[a, "L4"]["lo"] > 0
        lines.append(f"  {preset['arm_names'][a]}: " + ("as good as 4 layers and better than 2" if above_shallow
                                                        and not below_deep else "between 2 and 4 layers"
                                                        if above_shallow else "no better than 2 layers"))
    return lines


def summary(preset, rows, sweep=None):
    """The README figure's rows (+ where the deeper or looped arm errs less): 2 layers' error minus each of the
    others', paired by seed, over every k."""
    rep = [r for r in rows if r["role"] == "report"]
    err = {(r["arm"], r["seed"], str(r["passes"]), r["k"]): r["error"] for r in rep}
    seeds = sorted({r["seed"] for r in rep})
    out = []
    for arm in ("L4", "P", "S"):
        c = paired({k: [err["L2", s, "1", k] - err[arm, s, str(ARMS[arm]["n_passes"]), k] for s in seeds]
                    for k in range(1, HOPS + 1)})
        out.append((f"{preset['name']}: {preset['arm_names'][arm]} vs 2 layers, over k = 1..{HOPS}", c["diff"],
                    c["lo"], c["hi"]))
    return out


def figures(preset, rows, path, out=None):
    """Each arm's error per k at its trained passes (the mean over report seeds) beside Sanford et al.'s."""
    rep = [r for r in rows if r["role"] == "report" and str(r["passes"]) == str(ARMS[r["arm"]]["n_passes"])]
    curves = {f"{preset['arm_names'][a]} here": (list(range(1, HOPS + 1)), [np.mean(
        [r["error"] for r in rep if (r["arm"], r["k"]) == (a, k)]) for k in range(1, HOPS + 1)]) for a in ARMS}
    curves |= {f"Sanford depth {d} theirs": (list(range(1, HOPS + 1)), list(v)) for d, v in SANFORD.items()}
    title = f"{preset['name']}: k-hop induction, error per k ({len({r['seed'] for r in rep})} seeds)"
    return [path("errors.png")] if rep and plots.plot_loss_curves(curves, path("errors.png"), title, xlabel="k",
                                                                  ylabel="error") else []
