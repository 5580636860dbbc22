"""`ladder.py --plan CONFIG`: every run one config file's recipe trains (the run, or an [S] stable run and its
decay branches), with its train.py command, steps, tokens and FLOPs, and the train tokens the data must hold;
derived from the file through train.py's own settings and schedule (train.SETTINGS, train.plan_schedule)."""

import collections
import math
import os
import shlex

import grow
import match
import train
from model import ModelConfig
from tooling import guards, rundir


def recipe_plan(config_path, gpus=8):
    """The runs a config file's recipe trains on `gpus` processes, each number derived from the file and
    train.py's defaults, read as train.py reads them (train.SETTINGS). The run itself (with its growth
    step [X13] if it grows); with decay_tokens > 0 (the [S] recipe) that run is the stable phase and
    one decay branch [S] forks from each of its save_steps and from its end, named as
    rundir.resolve_run names a branch. Per run: its train.py command (torchrun for gpus > 1), steps,
    tokens and training FLOPs as train.py counts them (plan_flops); then the train tokens the data must
    hold (data_needs). A recipe that cannot run is a ValueError naming the setting. Returns the dict
    --plan --json prints."""
    given = train.SETTINGS.parse([config_path])  # what the file sets, over train.py's defaults
    values = train.SETTINGS.resolve(given)
    config, cfg = train.SETTINGS.build(train.TrainConfig, values), train.SETTINGS.build(ModelConfig, values)
    if values["init_from"]:
        raise ValueError(f"{config_path}: init_from={values['init_from']!r}: --plan plans a recipe from its first "
                         "step; this config continues another run")
    guards.derive_grad_accum(config, gpus)  # global_batch: the same step on any number of processes
    seqs = config.batch_size * config.grad_accum * gpus
    step_tokens = seqs * cfg.block_size
    schedule = train.plan_schedule(config, train.TrainState(), step_tokens)  # max_steps, decay start, growth step
    grown = None if schedule.grow_step is None else grow.grown_config(cfg, config.grow_to, config.grow_untie)
    points = branch_points(config_path, config, schedule)
    prefix = ["python"] if gpus == 1 else ["torchrun", "--standalone", f"--nproc_per_node={gpus}"]
    stable = rundir.RunDir(os.path.join(config.out_dir, config.run_name), sharded=config.sharded)
    runs = [dict(run_name=config.run_name, role="stable" if points else "run", argv=[config_path],
                 steps=schedule.max_steps, tokens=schedule.max_steps * step_tokens, windows=schedule.max_steps * seqs,
                 flops=plan_flops(cfg, grown, config, 0, schedule.max_steps, schedule.grow_step, step_tokens),
                 grow_step=schedule.grow_step, grow_to=config.grow_to if grown else None, run_dir=stable.path,
                 checkpoints=[stable.step_path(s) for s in sorted(set(config.save_steps))] + [stable.resume_path])]
    for step in points:
        source = stable.step_path(step) if step < schedule.max_steps else stable.resume_path
        argv = [f"--init_from={source}", f"--decay_tokens={config.decay_tokens}"]  # a fork with decay_tokens
        argv += [f"--{k}={values[k]}" for k in ("out_dir", "data_dir")  # paths never come from a checkpoint
                 if k in rundir.NOT_INHERITED_FORK and values[k] != train.DEFAULTS[k]]
        branch = train.SETTINGS.build(train.TrainConfig, train.SETTINGS.resolve(  # what the branch runs with
            train.SETTINGS.parse(argv), base=values, not_inherited=rundir.NOT_INHERITED_FORK))
        branch.decay_branch = True  # as rundir.is_decay_branch decides for this fork
        # a branch keeps the stable run's sequences per step (rundir: the checkpoint's global batch)
        state = train.TrainState(step=step, branch_start_step=step)
        steps = train.plan_schedule(branch, state, step_tokens).max_steps - step
        at_fork = grown if schedule.grow_step is not None and step > schedule.grow_step else cfg
        name = rundir.branch_run_name(config.run_name, step)
        runs.append(dict(run_name=name, role="branch", argv=argv, from_step=step, init_from=source,
                         decay_tokens=config.decay_tokens, steps=steps, tokens=steps * step_tokens,
                         windows=steps * seqs, flops=plan_flops(at_fork, None, branch, step, step + steps, None,
                                                                step_tokens),
                         run_dir=os.path.join(branch.out_dir, name)))
    for r in runs:
        r["command"] = shlex.join(prefix + ["train.py"] + r["argv"])
        r["flops_per_token"] = r["flops"] / r["tokens"]
    branch_windows = max((r["windows"] for r in runs if r["role"] == "branch"), default=0)
    return dict(config=config_path, processes=gpus, sequences_per_step=seqs, grad_accum=config.grad_accum,
                block_size=cfg.block_size, tokens_per_step=step_tokens, avg_doc_len=config.avg_doc_len or None,
                model=dict(layout=cfg.layout, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_expert=cfg.n_expert,
                           passes=cfg.n_passes, executed_layers=cfg.executed_layers()),
                runs=runs, total=dict(runs=len(runs), tokens=sum(r["tokens"] for r in runs),
                                      flops=sum(r["flops"] for r in runs)),
                data=data_needs(config, cfg, runs[0]["windows"], branch_windows, "branch_data_fraction" in given))


def branch_points(config_path, config, schedule):
    """[S] the steps decay branches fork from: every save step and the end of the stable run ([] without
    decay_tokens). Refused: a save step after the last step (never written), branches without held-back
    data, and a branch from a step the stable run's LR already decays at (guards.check_branch_source
    refuses it at training time)."""
    late = sorted(s for s in set(config.save_steps) if s > schedule.max_steps)
    if late:
        raise ValueError(f"{config_path}: save_steps {late} are after the last step (max_steps={schedule.max_steps}): "
                         "those checkpoints are never written")
    if config.decay_tokens <= 0:
        return []
    if config.branch_data_fraction == 0:
        raise ValueError(f"{config_path}: branch_data_fraction=0.0 holds no data back, but decay_tokens="
                         f"{config.decay_tokens} plans decay branches, which read only the held-back tail")
    points = sorted(s for s in set(config.save_steps) if s < schedule.max_steps) + [schedule.max_steps]
    decayed = [s for s in points if s > schedule.decay_start]
    if decayed:
        raise ValueError(f"{config_path}: decay_fraction={config.decay_fraction}: the stable run's LR decays from step "
                         f"{schedule.decay_start}, so a branch from step {decayed[0]} would raise it again; set "
                         "decay_fraction=0.0 (the decays are the branches [S])")
    return points


def plan_flops(cfg, grown, config, first, last, grow_step, step_tokens):
    """Training FLOPs of steps [first, last) as train.py logs them: each step's tokens x the FLOPs per
    token of the model that runs it (match.run_flops: every block execution, the config's avg_doc_len),
    the grown model from grow_step on [X13], each step at its drawn passes when n_passes_choices is set
    (train.passes_of_step: seeded by the step)."""
    if config.n_passes_choices:
        steps = collections.Counter((grow_step is not None and step >= grow_step, train.passes_of_step(config, step))
                                    for step in range(first, last))
    else:
        cut = last if grow_step is None else min(max(first, grow_step), last)
        steps = {(False, None): cut - first, (True, None): last - cut}
    phases = [(n * step_tokens, grown if after else cfg, k) for (after, k), n in steps.items() if n]
    return match.run_flops(cfg, phases, avg_doc_len=config.avg_doc_len or None)["flops"] if phases else 0.0


def smallest_train_split(stable_tokens, branch_tokens, fraction):
    """The fewest train tokens n whose regions, cut at n - int(n x fraction) (data.loader.held_back_start on
    a single shard; with several, its cut moves to the nearest shard boundary), hold stable_tokens before
    the cut and branch_tokens after it."""
    def holds(n):
        held = int(n * fraction)
        return n - held >= stable_tokens and held >= branch_tokens
    n = stable_tokens + branch_tokens
    if branch_tokens:  # both regions grow with n: start just below where each first fits, then step up
        n = max(n, math.floor(branch_tokens / fraction))
    n = max(0, max(n, math.floor((stable_tokens - 1) / (1 - fraction))) - 2)
    while not holds(n):
        n += 1
    return n


def data_needs(config, cfg, stable_windows, branch_windows, fraction_set):
    """What the train split must hold for the plan to read no token twice ([S]). A run reads windows of
    block_size + 1 tokens, block_size apart (data.loader.TokenStream): W windows need W x block_size + 1
    tokens. The stable run reads the region before the cut; every decay branch reads the held-back tail
    from its start (a fork onto another region starts at its beginning), so the tail must hold one
    branch. With the prepared data_dir present here, its regions are checked as well. Returns a dict:
    the token counts, notes (lines) and problems (lines: the plan would reread data, or a branch be
    refused)."""
    T, f = cfg.block_size, config.branch_data_fraction
    stable_need = stable_windows * T + 1
    branch_need = branch_windows * T + 1 if branch_windows else 0
    plain = stable_need + branch_need
    smallest = smallest_train_split(stable_need, branch_need, f)
    out = dict(stable_tokens=stable_need, branch_tokens=branch_need, read_tokens=plain, branch_data_fraction=f,
               exact_fraction=branch_need / plain, smallest_train_split=smallest, notes=[], problems=[],
               data_dir=config.data_dir, prepared_train_tokens=None)
    if branch_need:
        out["notes"].append(f"the stable region must hold {stable_need:,} tokens ({stable_windows:,} windows of "
                            f"block_size + 1), the held-back tail {branch_need:,} (one branch's {branch_windows:,} "
                            f"windows: every branch reads the same tail from its start); {plain:,} in all")
        held = int(plain * f)  # a split of exactly what the runs read, cut at f: what the tail gains, the stable lacks
        out["holds_one_branch"] = held >= branch_need
        out["notes"].append(
            f"branch_data_fraction {f:g} " + (f"holds one branch: of exactly {plain:,} train tokens it holds back "
                                              f"{held:,}, {held - branch_need:,} more than a branch reads, which the "
                                              "stable region then lacks" if held >= branch_need else
                                              f"does not hold one branch: of exactly {plain:,} train tokens it holds "
                                              f"back {held:,}, {branch_need - held:,} fewer than a branch reads "
                                              "(train.py would refuse the branches)")
            + f"; the fraction that fits exactly is {branch_need / plain:.6f}")
    else:
        out["notes"].append(f"the run reads {stable_windows:,} windows of block_size + 1 tokens: its region must hold "
                            f"{stable_need:,} tokens")
        if f > 0:
            out["notes"].append(f"branch_data_fraction {f:g}{'' if fraction_set else ' (train.py default)'} holds "
                                f"back the last {f:.1%} of the train split, which no run of this plan reads")
    extra = smallest - plain
    out["notes"].append(f"the train split must hold at least {smallest:,} tokens at branch_data_fraction {f:g}"
                        + (f" ({extra:,} = {extra / plain:.4%} more than the runs read)" if extra else ""))
    if extra > 0.01 * plain and branch_need:
        out["problems"].append(f"branch_data_fraction {f:g} leaves {extra / plain:.1%} of the data unread; "
                               f"{branch_need / plain:.6f} fits these runs exactly")
    from data import loader, prepare as prep
    try:
        meta = prep.load_meta(config.data_dir or prep.DEFAULT_OUT)
        n = int(meta["splits"]["train"]["tokens"])
    except (FileNotFoundError, ValueError, KeyError):
        out["notes"].append(f"data_dir {config.data_dir or '(the embedded corpus)'} is not prepared here: "
                            f"prepare at least {smallest:,} train tokens (data/prepare.py; the tail's start moves "
                            "to the nearest shard boundary, by up to half a shard: prepare that much more)")
        return out
    out["prepared_train_tokens"] = n
    cut = loader.held_back_start([s["tokens"] for s in meta["shards"]["train"]], f)  # as Data.stream cuts it
    have = ((cut - 1) // T, (n - cut - 1) // T)  # windows in the stable region and in the tail
    if have[0] < stable_windows:
        out["problems"].append(f"{config.data_dir or 'the embedded corpus'} holds {n:,} train tokens: its stable "
                               "region "
                               f"has {max(have[0], 0):,} windows, the stable run reads {stable_windows:,} "
                               f"({stable_windows / max(have[0], 1):.2f} epochs: data repeats)")
    if branch_windows and have[1] < branch_windows:
        out["problems"].append(f"{config.data_dir or 'the embedded corpus'} holds {n:,} train tokens: its held-back "
                               "tail "
                               f"has {max(have[1], 0):,} windows, a branch reads {branch_windows:,}: train.py refuses "
                               "the branches (they would reread data)")
    return out


def plan_text(plan):
    """--plan's printout of recipe_plan(...)."""
    lines = [f"{plan['config']}: {len(plan['runs'])} run{'s' if len(plan['runs']) > 1 else ''} on "
             f"{plan['processes']} process{'es' if plan['processes'] > 1 else ''}; a step is "
             f"{plan['sequences_per_step']} "
             f"sequences x {plan['block_size']} tokens = {plan['tokens_per_step']:,} tokens (grad_accum "
             f"{plan['grad_accum']}); FLOPs: train.py's count, match.flops_per_token at avg_doc_len "
             f"{plan['avg_doc_len'] or 'block_size'}"]
    for r in plan["runs"]:
        what = {"stable": "the WSD stable phase [S]", "run": "the run", "branch": f"decay branch [S] from step "
                f"{r.get('from_step')}: decay_tokens {r.get('decay_tokens', 0):,}"}[r["role"]]
        lines.append(f"  {r['run_name']} ({what}): {r['steps']:,} steps, {r['tokens']:,} tokens, "
                     f"{r['flops']:.4g} FLOPs "
                     f"({r['flops_per_token']:.4g} per token)")
        if r.get("grow_step") is not None:
            lines.append(f"    grows to {r['grow_to']} passes at step {r['grow_step']:,} [X13]")
        lines.append(f"    {r['command']}")
    t = plan["total"]
    if t["runs"] > 1:
        lines.append(f"  total: {t['runs']} runs, {t['tokens']:,} tokens trained, {t['flops']:.4g} FLOPs")
    d = plan["data"]
    lines.append(f"data ({d['data_dir'] or 'the embedded corpus'}):")
    lines += [f"  {n}" for n in d["notes"]] + [f"  PROBLEM: {p}" for p in d["problems"]]
    return "\n".join(lines)
