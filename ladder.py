"""
Both papers' experiments in miniature, end to end: grid -> match -> train -> fit -> report.

    python ladder.py --preset smelt-cpu-mini [--out out/ladder-smelt] [--bootstrap 2000]
    python ladder.py --preset x-cpu-mini [--out out/ladder-x]
    python ladder.py --preset smelt-micro          # seconds: the whole pipeline, numbers meaningless
    python ladder.py --list                        # every preset with its grid and estimated cost
    python ladder.py --preset smelt-cpu-mini --fit-only   # refit / re-report the finished runs only
    # GPU presets (documented, not run here); every rank runs the same ladder, rank 0 writes results
    torchrun --standalone --nproc_per_node=8 ladder.py --preset x-gpu-1node
    torchrun --nnodes=2 --node_rank=R --nproc_per_node=8 --master_addr=A --master_port=29500 \
        ladder.py --preset smelt-gpu-2node    # --out must be on a filesystem both nodes share

[S] SMELT protocol (kind "smelt"): every (scale, sparsity) cell has a MoE baseline; match.match() gives
its SMELT twin with the same per-token training FLOPs, non-embedding params and KV cache ([S] Table 10
ratios are printed). Both train on the same token sequence (same seed, batch and data order) with a
WSD stable phase (constant LR after warmup, never decayed) that saves checkpoints at `branch_steps`;
from each one a decay branch (cosine to 0 over `decay_tokens`, on the held-back tail of the train
split the stable phase never reads) gives one point (F, S, D, loss) of the [S2] surface L(F, S, D).
fit.py fits one surface per architecture; CE Gain [S5] with cell-bootstrap intervals and TPP
= D*/(F*/6) are reported at `budgets` (default: two budgets inside the measured compute range), and
the per-pair win counts (twin vs baseline at the same cell and branch).

[X] protocol (kind "x"): ladders of Vanilla (plain), Operator-1 (prelude-core-coda, K = 1, boundary
operator), Loop-2 (tied core, K = 2), Untied-2 (K = 2 independent cores), Loop-Grow and Untied-Grow
(K = 2 -> 4 at grow_at of training, i.e. rho = 1 - grow_at of the tokens after growth) at nominal
depths d with width = width_per_depth x d. The paper uses width = 128 x d (d8 = 1024 wide); CPU
presets use 16 x d (d3..d6 = 48..96 wide), head_dim 16 (n_head = width / 16) and mlp_hidden = 8/3 x
width rounded up to 32 (the [X] code rounds to 256, which at width 48 would be a 5x MLP). Every
architecture at a ladder point spends the same training compute: the budget is C(d) = tpp x N_s x F
of Vanilla at depth d (N_s stored params incl. the lm head [X10], F its analytic FLOPs per token,
match.py), and every architecture gets C(d) / F_arch tokens (growth: the token-weighted mean F of
its two phases). [X] Table 1 settings: no norm gains, QK-norm, embedding norm, the "x" init, Muon.
fit.py fits E on Vanilla (Huber), shared-E log-log regressions per architecture [X7], and the
compute multipliers: measured [X6] (interpolated between an architecture's own measured points) and
from the fitted laws, at Vanilla's budgets. The per-architecture LR tuning of [X] is NOT done here:
every architecture trains with the same settings (say so when quoting these numbers).

Presets (python ladder.py --list prints each with its number of runs and planned FLOPs):
  smelt-micro / x-micro     seconds; tests/test_ladder.py runs them end to end. Numbers mean nothing.
  smelt-cpu-mini            [S] scaled down: 3 scales (L4 w64, L6 w128, L8 w128) x 2 sparsities (top-2 of
                            8 or 16 experts of hidden size w) = 6 cells; 6 query / 3 KV heads of 16
                            (the twin gets 2 KV heads: KV matched exactly); context 128, batch 8;
                            stable phase 160 steps (164k tokens), branches at steps 40/80/160, each
                            decaying over 40,960 held-back tokens -> 18 surface points per architecture.
                            (Paper: 4 scales x 3-4 sparsities, 6 branches, 10B-token decays, 205B tokens.)
  x-cpu-mini                [X] scaled down: d3..d6 at width 16 x d, context 128, batch 8, budget
                            C(d) = 0.4 tokens per stored Vanilla parameter (the paper: TPP ~5 at 128 x d);
                            the 4096-token lm head is a large share of every model's FLOPs at this width.
  smelt-gpu-1node/2node,    sized for one / two 8-GPU nodes (documented, not run here); they read
  x-gpu-1node/2node         data/cache/fineweb (prepare it with data/prepare.py), see GPU_DATA.
Measured on this 2-core machine (1 torch thread, other jobs running): see the README for the
cpu-mini wall times; every run's own time is in its result.json ("seconds").

Resumable: every run lives in OUT/runs/<run_id>/ (train.py's ckpt.pt, log.jsonl, train.out = its
printed output) and is finished when OUT/runs/<run_id>/result.json exists, written atomically after
training. A finished run is never redone (a result from different settings is an error, not a silent
mix; a setting added to model.py / train.py since, left at its default, is not a difference); an
unfinished run is restarted from scratch. So killing the ladder at any moment and running the
same command again continues where it stopped. OUT/runs.csv, OUT/report.txt and OUT/report.json are
rebuilt from the result files at the end of every invocation. Decay branches delete their own
ckpt.pt when finished unless --keep-checkpoints (stable checkpoints are kept: branches need them).
"""

import argparse
import contextlib
import csv
import io
import json
import math
import os
import shutil
import sys
from dataclasses import asdict, dataclass, field, replace

import numpy as np
from tqdm import tqdm

import fit
import match
import train
from data.prepare import write_atomic
from grow import growth_step
from model import ModelConfig

# ----------------------------------------------------------------------------------------------------
# Presets. Shared model/training settings first, then one dict per preset.

TOKENIZER_MODEL = dict(vocab_size=4096, eot_token=4095)  # data/cache/default (gpt2-4096)

# [S]: MoE baselines, top-2 of fine-grained experts; 6 query heads of 16 on 3 KV heads, so that the
# SMELT twin (1.5x the executed layers) matches the KV cache exactly with 2 KV heads of 16.
SMELT_MODEL = dict(TOKENIZER_MODEL, n_head=6, n_kv_head=3, head_dim=16, top_k=2, layout="plain", n_loops=1)
# match.match keyword arguments for small widths: finer width / hidden / expert grids than the
# paper-scale defaults (multiples of 32 / 16 / 8 leave no feasible twin at width 64)
SMELT_MATCH = dict(width_multiple=(16, 8), hidden_multiple=8, expert_multiple=1)
# [X] Table 1
X_MODEL = dict(TOKENIZER_MODEL, norm_gain=False, qk_norm=True, embed_norm=True, init="x")
# GPU presets need far more tokens than the embedded corpus (0.8M): prepare e.g. FineWeb shards with
#   python -m data.prepare /path/to/fineweb/*.jsonl --out data/cache/fineweb
GPU_DATA = "data/cache/fineweb"
X_ARCHS = ("vanilla", "operator-1", "loop-2", "untied-2", "loop-grow", "untied-grow")

SMELT_GPU_1NODE = dict(
    kind="smelt", about="one 8-GPU node (documented, not run): 4 scales x 3 sparsities, 6 branches",
    model=dict(TOKENIZER_MODEL, n_head=8, n_kv_head=4, head_dim=64, top_k=8, layout="plain", n_loops=1,
               block_size=1024),
    scales={"L8w512": dict(n_layer=8, n_embd=512, expert_hidden=176),
            "L10w640": dict(n_layer=10, n_embd=640, expert_hidden=208),
            "L12w768": dict(n_layer=12, n_embd=768, expert_hidden=256),
            "L16w1024": dict(n_layer=16, n_embd=1024, expert_hidden=336)},
    cells=[(s, e) for s in ("L8w512", "L10w640", "L12w768", "L16w1024") for e in (48, 96, 128)],
    recipe="smelt", match_kwargs=dict(width_multiple=(32, 16), expert_multiple=4),
    train=dict(optimizer="adamw", batch_size=16, grad_accum=1, warmup_steps=200, eval_tokens=1 << 20,
               data_dir=GPU_DATA),
    branch_steps=[500, 1000, 2000, 4000, 8000, 12000], decay_tokens=1000 * 16 * 1024 * 8, gpus=8,
    budgets=None, bootstrap=2000, seed=1337)

PRESETS = {
    # ---- [S] SMELT
    "smelt-micro": dict(
        kind="smelt", about="pipeline check in seconds (tests); the numbers mean nothing",
        model=dict(SMELT_MODEL, block_size=32),
        scales={"w64": dict(n_layer=4, n_embd=64, expert_hidden=64),
                "w96": dict(n_layer=4, n_embd=96, expert_hidden=96),
                "w128": dict(n_layer=4, n_embd=128, expert_hidden=128)},
        cells=[("w64", 8), ("w64", 16), ("w96", 8), ("w128", 16)],  # (scale, experts per layer)
        recipe="smelt", match_kwargs=SMELT_MATCH,
        train=dict(optimizer="adamw", batch_size=4, warmup_steps=2, eval_tokens=512),
        branch_steps=[4, 8], decay_tokens=512, budgets=None, bootstrap=20, seed=1337, threads=1),
    "smelt-cpu-mini": dict(
        kind="smelt", about="[S] in miniature: 3 scales x 2 sparsities, 3 decay branches per cell, "
                            "under an hour on 2 CPU cores",
        model=dict(SMELT_MODEL, block_size=128),
        scales={"L4w64": dict(n_layer=4, n_embd=64, expert_hidden=64),
                "L6w128": dict(n_layer=6, n_embd=128, expert_hidden=128),
                "L8w128": dict(n_layer=8, n_embd=128, expert_hidden=128)},
        cells=[("L4w64", 8), ("L4w64", 16), ("L6w128", 8), ("L6w128", 16), ("L8w128", 8), ("L8w128", 16)],
        recipe="smelt", match_kwargs=SMELT_MATCH,
        train=dict(optimizer="adamw", batch_size=8, warmup_steps=10, eval_tokens=1 << 15),
        branch_steps=[40, 80, 160], decay_tokens=40960, budgets=None, bootstrap=2000, seed=1337, threads=1),
    "smelt-gpu-1node": SMELT_GPU_1NODE,
    "smelt-gpu-2node": dict(SMELT_GPU_1NODE, about="two 8-GPU nodes (documented, not run): the 1-node grid, "
                                                  "2x the tokens per step",
                            decay_tokens=1000 * 16 * 1024 * 16, gpus=16),
    # ---- [X] scaling exponents
    "x-micro": dict(
        kind="x", about="pipeline check in seconds (tests); the numbers mean nothing",
        model=dict(X_MODEL, block_size=32), depths=[2, 3, 4, 5], width_per_depth=16, head_dim=16,
        mlp_multiple=32, archs=X_ARCHS, tpp=0.005, grow_at=0.7, grow_to=4, rewarm_fraction=0.05,
        train=dict(optimizer="muon", batch_size=4, warmup_fraction=0.1, decay_fraction=0.3, eval_tokens=512),
        seed=1337, threads=1),
    "x-cpu-mini": dict(
        kind="x", about="[X] in miniature: 6 ladders x 4 depths at width 16 x depth, equal FLOPs per "
                        "point, under an hour on 2 CPU cores",
        model=dict(X_MODEL, block_size=128), depths=[3, 4, 5, 6], width_per_depth=16, head_dim=16,
        mlp_multiple=32, archs=X_ARCHS, tpp=0.4, grow_at=0.7, grow_to=4, rewarm_fraction=0.05,
        train=dict(optimizer="muon", batch_size=8, warmup_fraction=0.05, decay_fraction=0.3, eval_tokens=1 << 15),
        seed=1337, threads=1),
    "x-gpu-1node": dict(
        kind="x", about="one 8-GPU node (documented, not run): the paper's width 128 x depth, d6..d10, TPP 5",
        model=dict(X_MODEL, block_size=2048), depths=[6, 7, 8, 9, 10], width_per_depth=128, head_dim=128,
        mlp_multiple=256, archs=X_ARCHS, tpp=5.0, grow_at=0.7, grow_to=4, rewarm_fraction=0.02, gpus=8,
        train=dict(optimizer="muon", batch_size=16, grad_accum=2, warmup_fraction=0.02, decay_fraction=0.3,
                   eval_tokens=1 << 21, data_dir=GPU_DATA), seed=1337),
    "x-gpu-2node": dict(
        kind="x", about="two 8-GPU nodes (documented, not run): d8..d12 at width 128 x depth, TPP 5",
        model=dict(X_MODEL, block_size=2048), depths=[8, 9, 10, 11, 12], width_per_depth=128, head_dim=128,
        mlp_multiple=256, archs=X_ARCHS, tpp=5.0, grow_at=0.7, grow_to=4, rewarm_fraction=0.02, gpus=16,
        train=dict(optimizer="muon", batch_size=16, grad_accum=1, warmup_fraction=0.02, decay_fraction=0.3,
                   eval_tokens=1 << 21, data_dir=GPU_DATA), seed=1337),
}


def get_preset(name, **overrides):
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    preset = json.loads(json.dumps(PRESETS[name]))  # deep copy (tuples become lists)
    for key, value in overrides.items():
        if value is not None:
            preset[key] = value
    preset["name"] = name
    return preset


# ----------------------------------------------------------------------------------------------------
# Runs: a RunSpec is one train.train() call; its result.json marks it finished


@dataclass
class RunSpec:
    run_id: str  # unique in the ladder; the run's folder name
    arch: str
    cell: str  # SMELT: "<scale>-e<experts>" (shared by baseline and twin); [X]: "d<depth>"
    role: str  # "stable" (branch source), "branch" (a decay branch -> one fit point) or "run" ([X])
    settings: dict  # train.train overrides (out_dir / run_name are filled in by run_ladder)
    meta: dict = field(default_factory=dict)  # what the report needs: F, S, depth, target C, ...
    needs: str = ""  # run_id whose checkpoint this run starts from


def write_json_atomic(path, obj):
    """JSON through a temp file and a rename (data.prepare.write_atomic): never half a result file."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = json.dumps(obj, indent=1, default=_json_default)
    write_atomic(path, lambda f: f.write(text.encode()))


def _json_default(v):
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    raise TypeError(f"not JSON serialisable: {type(v).__name__}")


def run_dir(out_dir, run_id):
    return os.path.join(out_dir, "runs", run_id)


def load_result(out_dir, spec):
    """The finished result of `spec`, or None. A result written with other settings is an error."""
    path = os.path.join(run_dir(out_dir, spec.run_id), "result.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable result file ({e}); delete it to rerun that run") from None
    if not same_settings(result.get("settings"), spec.settings):
        raise ValueError(f"{path}: this run was finished with different settings than preset asks for now; "
                         f"use another --out, or delete {os.path.dirname(path)} to rerun it")
    return result


def _canonical(obj):
    return json.loads(json.dumps(obj, sort_keys=True, default=_json_default))


def setting_default(key):
    """The value a setting has when nobody sets it: train.py's default (model fields included)."""
    return train.DEFAULTS.get(key, ...)


def same_settings(stored, now):
    """Settings equal, except keys one side lacks that are at their default on the other side (a
    setting added to model.py / train.py since the run finished does not invalidate it)."""
    stored, now = _canonical(stored or {}), _canonical(now)
    for key in set(stored) | set(now):
        if key in stored and key in now:
            if stored[key] != now[key]:
                return False
        elif _canonical({"v": (stored if key in stored else now)[key]}) != _canonical({"v": setting_default(key)}):
            return False
    return True


def _barrier():
    """All DDP ranks wait here (no-op without torch.distributed): rank 0 writes results/checkpoints."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _quiet(*args, **kwargs):
    pass


def _is_master():
    import torch.distributed as dist
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def run_ladder(specs, out_dir, train_fn=None, progress=True, keep_checkpoints=False, log=print):
    """Train every spec that has no result yet, in order; returns {run_id: result}. train_fn defaults
    to train.train (tests pass a counting wrapper). Stops with ValueError when a run's source
    checkpoint is missing."""
    train_fn = train_fn or train.train
    results = {s.run_id: load_result(out_dir, s) for s in specs}
    ids = [s.run_id for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate run ids in the ladder")
    todo = [s for s in specs if results[s.run_id] is None]
    log(f"ladder {out_dir}: {len(specs)} runs, {len(specs) - len(todo)} finished, {len(todo)} to train")
    bar = tqdm(total=len(specs), initial=len(specs) - len(todo), desc="ladder", unit="run",
               disable=not (progress and _is_master()), position=0, dynamic_ncols=True)
    for spec in todo:
        directory = run_dir(out_dir, spec.run_id)
        if _is_master() and os.path.isdir(directory):  # an interrupted attempt: start it again
            shutil.rmtree(directory, ignore_errors=True)
        _barrier()
        settings = dict(spec.settings, out_dir=os.path.join(out_dir, "runs"), run_name=spec.run_id,
                        progress=progress)
        if spec.needs:
            source = settings["init_from"] = init_path(spec, out_dir)
            if not os.path.exists(source):
                raise ValueError(f"run {spec.run_id} starts from {source}, which is missing (the finished "
                                 f"run {spec.needs} lost its checkpoints?); delete {run_dir(out_dir, spec.needs)} "
                                 "to retrain it")
        bar.set_postfix_str(spec.run_id)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "train.out"), "a") as out, contextlib.redirect_stdout(out):
            summary = train_fn(settings)
        result = dict(run_id=spec.run_id, arch=spec.arch, cell=spec.cell, role=spec.role,
                      settings=spec.settings, meta=spec.meta, needs=spec.needs,
                      **{k: summary.get(k) for k in ("val_loss", "val_loss_by_source", "tokens", "flops", "step",
                                                     "max_steps", "seconds", "unigram_entropy", "data_region",
                                                     "data_read", "data_split", "ckpt_path", "log_path")})
        if summary.get("train_losses"):
            result["final_train_loss"] = float(np.mean(summary["train_losses"][-max(1, len(summary["train_losses"]) // 10):]))
        if _is_master():
            if spec.role == "branch" and not keep_checkpoints and os.path.exists(summary.get("ckpt_path") or ""):
                os.remove(summary["ckpt_path"])  # a branch's final weights are not needed by the ladder
                result["ckpt_path"] = None
            write_json_atomic(os.path.join(directory, "result.json"), result)
        _barrier()
        results[spec.run_id] = result
        bar.update(1)
        loss = result["val_loss"]
        if _is_master():
            bar.write(f"  {spec.run_id}: val loss {loss:.4f}, {result['tokens']:,} tokens, "
                      f"{result['flops']:.3e} FLOPs, {result['seconds']:.0f} s" if loss is not None
                      else f"  {spec.run_id}: done")
    bar.close()
    return results


# ----------------------------------------------------------------------------------------------------
# [S] SMELT grid


def smelt_cells(preset):
    """[(cell name, baseline ModelConfig, SMELT twin ModelConfig, match report)] for every cell."""
    cells = []
    for scale, n_expert in preset["cells"]:
        if scale not in preset["scales"]:
            raise ValueError(f"preset {preset['name']}: cell ({scale}, {n_expert}) names an unknown scale; "
                             f"scales are {sorted(preset['scales'])}")
        fields_ = dict(preset["model"], **preset["scales"][scale], n_expert=n_expert)
        baseline = ModelConfig.from_dict(fields_)
        try:
            twin, report = match.match(baseline, preset["recipe"], **preset.get("match_kwargs", {}))
        except ValueError as e:
            raise ValueError(f"preset {preset['name']}, cell {scale}-e{n_expert}: {e}") from None
        cells.append((f"{scale}-e{n_expert}", baseline, twin, report))
    return cells


def model_settings(cfg):
    """ModelConfig -> train.py model overrides (the resolved fields, so the run is fully specified)."""
    d = asdict(cfg)
    d.pop("use_triton", None)
    return d


def smelt_specs(preset, cells=None):
    """Per cell and architecture: one stable run saving checkpoints at branch_steps, then one decay
    branch per checkpoint. Baseline and twin share seed, batch and data: the same token sequence."""
    cells = smelt_cells(preset) if cells is None else cells
    steps = sorted(preset["branch_steps"])
    if not steps or steps[0] < 1:
        raise ValueError(f"preset {preset['name']}: branch_steps must be positive step numbers, got {steps}")
    common = dict(preset["train"], seed=preset["seed"], decay_fraction=0.0, eval_interval=steps[-1])
    specs = []
    for cell, baseline, twin, _ in cells:
        attended = match.resolve_attended(baseline)
        for arch, cfg in (("baseline", baseline), ("smelt", twin)):
            F = train.flops_per_token(cfg)
            S = match.sparsity(cfg, attended, baseline=baseline)["S"]
            N = match.accounting(cfg, attended)["params_nonembedding"]
            meta = dict(F=F, S=S, N=N, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_expert=cfg.n_expert,
                        layout=cfg.layout)
            stable_id = f"{arch}-{cell}-stable"
            specs.append(RunSpec(stable_id, arch, cell, "stable",
                                 dict(common, **model_settings(cfg), max_steps=steps[-1], save_steps=steps), meta))
            for step in steps:
                source = f"{{runs}}/{stable_id}/ckpt_step{step}.pt"
                specs.append(RunSpec(f"{arch}-{cell}-decay{step}", arch, cell, "branch",
                                     dict(init_from=source, decay_branch=True, decay_tokens=preset["decay_tokens"],
                                          eval_tokens=preset["train"].get("eval_tokens", 16384),
                                          eval_interval=10 ** 9),
                                     dict(meta, branch_step=step), needs=stable_id))
    return specs


def init_path(spec, out_dir):
    """The checkpoint a run starts from. Specs say "{runs}/<stable run>/ckpt_step<N>.pt" so that the
    settings identifying a run do not depend on where its output folder is."""
    return spec.settings["init_from"].replace("{runs}", os.path.join(out_dir, "runs"))


def sources_of(results):
    names = []
    for r in results:
        for k in (r.get("val_loss_by_source") or {}):
            if k not in names:
                names.append(k)
    return names


def smelt_rows(results):
    """One CSV row per finished decay branch: arch, cell, F, S, D, C, loss (+ val loss per source)."""
    branch = [r for r in results if r and r["role"] == "branch"]
    sources = sources_of(branch)
    rows = []
    for r in branch:
        m = r["meta"]
        # F: the per-token training FLOPs train.py counted (= match.py's analytic F when the run was made)
        row = dict(arch=r["arch"], cell=r["cell"], branch_step=m["branch_step"], F=r["flops"] / r["tokens"], S=m["S"],
                   D=r["tokens"], C=r["flops"], loss=r["val_loss"], N=m["N"], n_layer=m["n_layer"],
                   n_embd=m["n_embd"], n_expert=m["n_expert"], run_id=r["run_id"], seconds=r["seconds"])
        for s in sources:
            row[f"loss_{s}"] = (r.get("val_loss_by_source") or {}).get(s)
        rows.append(row)
    return rows


def columns_to_arrays(rows, keys=("arch", "cell", "F", "S", "D", "loss")):
    return {k: np.asarray([r[k] for r in rows], dtype=object if k in ("arch", "cell") else float) for k in keys}


def default_budgets(C):
    """Two budgets inside the measured compute range: its geometric middle and its top."""
    C = np.asarray(C, dtype=float)
    return [float(np.exp(np.mean(np.log([C.min(), C.max()])))), float(C.max())]


def surface_bootstrap(runs, ref, target, budgets, sparsities, n_draws, seed=0, full_fits=None, progress=True):
    """fit.cell_bootstrap on a small grid: with few cells some draws leave a six-coefficient surface
    underdetermined; fit.cell_bootstrap leaves those out (counted here as "skipped")."""
    out = fit.cell_bootstrap(runs, ref, target, budgets, sparsities, n_draws=n_draws, seed=seed,
                             n_workers=1 if n_draws <= 50 else None, full_fits=full_fits, progress=progress)
    out["skipped"] = out["n_failed"]
    return out


def match_table(cells):
    """[S] Table 10 style: per cell the baseline and its SMELT twin, F / N / KV ratios, sparsities."""
    lines, records = [], []
    lines.append("matching ([S] Table 10 ratios: SMELT / baseline)")
    lines.append(f"  {'cell':<12} {'baseline H/E/kv':>16} {'SMELT H/E/kv':>14} {'F':>7} {'N':>7} {'KV':>7} {'S_base':>7} {'S_smelt':>7}")
    for name, b, t, rep in cells:
        r = rep["ratios"]
        s_b, s_t = rep["sparsity_baseline"]["S"], rep["sparsity_matched"]["S"]
        lines.append(f"  {name:<12} {f'{b.n_embd}/{b.n_expert}/{b.n_kv_head}x{b.head_dim}':>16} "
                     f"{f'{t.n_embd}/{t.n_expert}/{t.n_kv_head}x{t.head_dim}':>14} {r['flops']:7.4f} "
                     f"{r['params']:7.4f} {r['kv']:7.4f} {s_b:7.3f} {s_t:7.3f}")
        shape = lambda c, S: dict(n_embd=c.n_embd, n_expert=c.n_expert, n_head=c.n_head, n_kv_head=c.n_kv_head,
                                  head_dim=c.head_dim, S=S)
        records.append(dict(cell=name, ratios=r, baseline=shape(b, s_b), smelt=shape(t, s_t)))
    return lines, records


def win_counts(rows, ref="baseline", target="smelt", key="loss"):
    """Pairs (same cell and branch step) where the target's loss is lower: (wins, pairs)."""
    by = {(r["arch"], r["cell"], r["branch_step"]): r for r in rows}
    wins = pairs = 0
    for (a, cell, step), r in by.items():
        other = by.get((target, cell, step))
        if a != ref or other is None or r.get(key) is None or other.get(key) is None:
            continue
        pairs += 1
        wins += other[key] < r[key]
    return wins, pairs


def smelt_report(preset, cells, rows, n_boot, seed=0, progress=True, plot_path=None):
    """Fit both surfaces, CE Gain with cell-bootstrap intervals, TPP, win counts -> (text, dict)."""
    lines, out = [], {"preset": preset["name"], "match": [], "fits": {}, "ce_gain": [], "tpp": [], "wins": {}}
    lines.append(f"== {preset['name']}: [S] SMELT vs matched baseline ({len(cells)} cells)")
    table, out["match"] = match_table(cells)
    lines += table
    if not rows:
        lines.append("no finished decay branches yet")
        return "\n".join(lines), out
    wins, pairs = win_counts(rows)
    out["wins"]["all"] = [wins, pairs]
    lines.append(f"per-pair wins (SMELT loss < baseline loss at the same cell and branch): {wins}/{pairs}")
    for s in sources_of_rows(rows):
        w, p = win_counts(rows, key=f"loss_{s}")
        out["wins"][s] = [w, p]
        lines.append(f"  on {s}: {w}/{p}")
    runs = columns_to_arrays(rows)
    fits = {}
    for arch in ("baseline", "smelt"):
        m = runs["arch"].astype(str) == arch
        try:
            fits[arch] = fit.fit_surface(runs["F"][m], runs["S"][m], runs["D"][m], runs["loss"][m])
        except ValueError as e:
            lines.append(f"surface fit of {arch} not possible: {e}")
            out["fits"][arch] = {"error": str(e)}
    if len(fits) < 2:
        lines.append("CE Gain and TPP need both surfaces; train more cells/branches")
        return "\n".join(lines), out
    lines.append("[S2] surfaces L = E + A (1-S)^b / F^a + K / D^c (Huber on log-loss, fit.py)")
    lines.append(f"  {'arch':>9} {'E':>8} {'A':>10} {'a':>7} {'b':>7} {'K':>10} {'c':>7} {'gamma':>7} {'rmse':>8} {'pts':>4}")
    for arch, f in fits.items():
        lines.append(f"  {arch:>9} {f.E:8.4f} {f.A:10.4g} {f.a:7.4f} {f.b:7.4f} {f.K:10.4g} {f.c:7.4f} "
                     f"{f.gamma:7.4f} {f.rmse:8.5f} {f.n_points:4d}")
        out["fits"][arch] = dict(f.to_dict(), n_points=f.n_points)
        if f.a < 1e-3 or f.c < 1e-3:  # [S3]-[S4] need a, c > 0: no compute-optimal frontier otherwise
            which = "F" if f.a < 1e-3 else "D"
            lines.append(f"  note: the {arch} surface is degenerate ({'a' if which == 'F' else 'c'} = "
                         f"{min(f.a, f.c):.2g}): on this grid its loss does not fall with {which}, so its "
                         "frontier, and every CE Gain / TPP that uses it, is undefined")
            out["fits"][arch]["degenerate"] = True
    budgets = preset.get("budgets") or default_budgets(runs["F"] * runs["D"])
    sparsities = sorted({round(float(s), 3) for s in runs["S"][runs["arch"].astype(str) == "baseline"]})
    boot = None
    if n_boot:
        try:
            boot = surface_bootstrap(runs, "baseline", "smelt", budgets, sparsities, n_boot, seed=seed,
                                     full_fits=fits, progress=progress)
        except ValueError as e:
            lines.append(f"cell bootstrap failed: {e}")
    CC, SS = np.meshgrid(budgets, sparsities, indexing="ij")
    gain = fit.ce_gain(fits["baseline"], fits["smelt"], CC, SS)
    note = ""
    if boot:
        note = f" ({boot['n_draws']} cell-bootstrap draws, 95%"
        note += f"; {boot['skipped']} underdetermined draws skipped)" if boot["skipped"] else ")"
    lines.append(f"[S5] CE Gain of SMELT over the baseline{note}; > 0: SMELT needs less compute. Budgets C inside the measured "
                 f"{runs['F'].min() * runs['D'].min():.3g}..{(runs['F'] * runs['D']).max():.3g} FLOPs")
    for i, C in enumerate(budgets):
        for j, S in enumerate(sparsities):
            lo = hi = None
            if boot and "ce_gain" in boot["lo"]:
                lo, hi = float(boot["lo"]["ce_gain"][i, j]), float(boot["hi"]["ce_gain"][i, j])
            ci = f"  [{_fmt(lo, '+.3f')}, {_fmt(hi, '+.3f')}]" if lo is not None else ""
            lines.append(f"  C={C:.3g} S={S:.3f}: {_fmt(gain[i, j], '+.4f')}{ci}")
            out["ce_gain"].append(dict(C=C, S=S, value=_finite(gain[i, j]), lo=_finite(lo), hi=_finite(hi)))
    lines.append("TPP = D*/(F*/6) at the same budgets")
    for role, arch in (("ref", "baseline"), ("target", "smelt")):
        values = fit.tpp(fits[arch], CC, SS)
        for i, C in enumerate(budgets):
            for j, S in enumerate(sparsities):
                lo = hi = None
                if boot and f"{role}.tpp" in boot["lo"]:
                    lo, hi = float(boot["lo"][f"{role}.tpp"][i, j]), float(boot["hi"][f"{role}.tpp"][i, j])
                ci = f"  [{_fmt(lo, '.3g')}, {_fmt(hi, '.3g')}]" if lo is not None else ""
                lines.append(f"  {arch:>9} C={C:.3g} S={S:.3f}: {_fmt(values[i, j], '.4g')}{ci}")
                out["tpp"].append(dict(arch=arch, C=C, S=S, value=_finite(values[i, j]), lo=_finite(lo),
                                       hi=_finite(hi)))
    if plot_path:  # fit.py's frontier plot over the measured compute range (needs matplotlib)
        C_all = runs["F"] * runs["D"]
        if fit.plot_surface_frontiers(fits, sparsities, plot_path, C_range=(float(C_all.min()), float(C_all.max()))):
            lines.append(f"plot: {plot_path}")
    return "\n".join(lines), out


def _finite(v):
    """float, or None for a missing / non-finite value (JSON has no inf or nan)."""
    return None if v is None or not np.isfinite(float(v)) else float(v)


def _fmt(v, spec):
    return "undefined" if _finite(v) is None else format(float(v), spec)


def sources_of_rows(rows):
    return [k[len("loss_"):] for k in (rows[0] if rows else {}) if k.startswith("loss_")]


# ----------------------------------------------------------------------------------------------------
# [X] ladders


def x_config(preset, arch, depth):
    """(ModelConfig at the start of training, train.py growth overrides) of one ladder point."""
    width = preset["width_per_depth"] * depth
    hd = preset["head_dim"]
    if width % hd:
        raise ValueError(f"preset {preset['name']}: width {width} at depth {depth} is not a multiple of head_dim {hd}")
    mult = preset["mlp_multiple"]
    base = dict(preset["model"], n_layer=depth, n_embd=width, n_head=width // hd, head_dim=hd,
                mlp_hidden=mult * math.ceil(8 * width / 3 / mult))
    pcc = dict(layout="pcc", boundary="both")
    shapes = {
        "vanilla": dict(layout="plain"),
        "operator-1": dict(pcc, n_passes=1),
        "loop-2": dict(pcc, n_passes=2, tie_core=True),
        "untied-2": dict(pcc, n_passes=2, tie_core=False),
        "loop-grow": dict(pcc, n_passes=2, tie_core=True),
        "untied-grow": dict(pcc, n_passes=2, tie_core=False),
    }
    if arch not in shapes:
        raise ValueError(f"unknown [X] architecture {arch!r}; choose from {list(shapes)}")
    cfg = ModelConfig.from_dict(dict(base, **shapes[arch]))
    grow = {}
    if arch.endswith("-grow"):
        grow = dict(grow_at=preset["grow_at"], grow_to=preset["grow_to"], grow_untie=False)
    return cfg, grow


def x_flops_per_token(cfg, grow, steps):
    """Mean training FLOPs per token over `steps` steps, growing at the step train.py grows at."""
    if not grow:
        return train.flops_per_token(cfg)
    g = growth_step(steps, grow["grow_at"])
    grown = replace(cfg, n_passes=grow["grow_to"])  # untied growth copies cores: the grown stored model
    return (g * train.flops_per_token(cfg) + (steps - g) * train.flops_per_token(grown)) / steps


def world_size(preset=None):
    """DDP processes (torchrun sets WORLD_SIZE): a step reads batch_size x grad_accum x world sequences.
    Outside torchrun a preset's intended `gpus` is used for planning only (--list)."""
    if "WORLD_SIZE" in os.environ or preset is None:
        return int(os.environ.get("WORLD_SIZE", "1"))
    return int(preset.get("gpus", 1))


def x_specs(preset, world=None):
    """One run per (architecture, depth); every architecture at a depth gets the same compute."""
    t = dict(preset["train"])
    warmup_fraction = t.pop("warmup_fraction", 0.05)
    tokens_per_step = t["batch_size"] * t.get("grad_accum", 1) * preset["model"]["block_size"] * (world or world_size())
    specs = []
    for depth in preset["depths"]:
        vanilla, _ = x_config(preset, "vanilla", depth)
        a = match.accounting(vanilla)
        budget = preset["tpp"] * a["params_stored"] * train.flops_per_token(vanilla)  # C(d)
        for arch in preset["archs"]:
            cfg, grow = x_config(preset, arch, depth)
            steps = max(1, round(budget / train.flops_per_token(cfg) / tokens_per_step))
            for _ in range(3):  # growth: mean F depends on the step count; settle it
                steps = max(1, round(budget / x_flops_per_token(cfg, grow, steps) / tokens_per_step))
            if steps < 4:
                raise ValueError(f"preset {preset['name']}: {arch} at d{depth} gets {steps} steps; raise tpp")
            settings = dict(t, **model_settings(cfg), **grow, seed=preset["seed"], max_steps=steps,
                            warmup_steps=max(1, round(warmup_fraction * steps)), eval_interval=steps)
            if grow:
                settings["grow_rewarm_steps"] = max(1, round(preset["rewarm_fraction"] * steps))
            acc = match.accounting(cfg)
            meta = dict(depth=depth, width=cfg.n_embd, budget=budget, N_s=acc["params_stored"],
                        N_c=acc["params_compute_active"], F=x_flops_per_token(cfg, grow, steps),
                        executed_layers=acc["executed_layers"], stored_blocks=acc["stored_blocks"])
            specs.append(RunSpec(f"{arch}-d{depth}", arch, f"d{depth}", "run", settings, meta))
    return specs


def x_rows(results):
    rows = []
    sources = sources_of([r for r in results if r])
    for r in results:
        if not r:
            continue
        m = r["meta"]
        row = dict(arch=r["arch"], cell=r["cell"], depth=m["depth"], width=m["width"], C=r["flops"],
                   C_target=m["budget"], D=r["tokens"], F=m["F"], N_s=m["N_s"], N_c=m["N_c"],
                   loss=r["val_loss"], run_id=r["run_id"], seconds=r["seconds"])
        for s in sources:
            row[f"loss_{s}"] = (r.get("val_loss_by_source") or {}).get(s)
        rows.append(row)
    return rows


def x_report(preset, rows, ref="vanilla", plot_path=None):
    """Shared-E power laws [X5]-[X7] and compute multipliers [X6] -> (text, dict)."""
    lines = [f"== {preset['name']}: [X] ladders at width {preset['width_per_depth']} x depth, equal FLOPs per point"]
    out = {"preset": preset["name"], "fits": {}, "multipliers": {}, "points": []}
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    depths = sorted({r["depth"] for r in rows})
    lines.append("final validation loss (rows: architecture; columns: depth; C = training FLOPs)")
    lines.append(f"  {'':>12} " + " ".join(f"{f'd{d}':>9}" for d in depths))
    by = {(r["arch"], r["depth"]): r for r in rows}
    C_row = [by.get((ref, d)) for d in depths]
    lines.append(f"  {'C':>12} " + " ".join(f"{r['C']:9.3g}" if r else f"{'-':>9}" for r in C_row))
    for a in archs:
        cells = [by.get((a, d)) for d in depths]
        lines.append(f"  {a:>12} " + " ".join(f"{r['loss']:9.4f}" if r else f"{'-':>9}" for r in cells))
    spread = max((abs(r["C"] / r["C_target"] - 1) for r in rows), default=0.0)
    lines.append(f"  (measured C within {spread * 100:.1f}% of each point's target budget: whole steps)")
    runs = {}
    for a in archs:
        pts = sorted((r["C"], r["loss"]) for r in rows if r["arch"] == a)
        runs[a] = (np.array([p[0] for p in pts]), np.array([p[1] for p in pts]))
    if ref not in runs:
        lines.append(f"no {ref} runs yet: nothing to fit")
        return "\n".join(lines), out
    C0 = float(np.exp(np.mean(np.log(runs[ref][0]))))  # [X] C0 = where Vanilla is tuned; here its mid budget
    try:
        ref_fit = fit.fit_power_law(*runs[ref], C0=C0)
    except ValueError as e:
        lines.append(f"[X7] E cannot be fitted on {ref}: {e}")
        return "\n".join(lines), out
    lines.append(f"[X7] E = {ref_fit.E:.4f} (Huber fit on {ref}), C0 = {C0:.3g}; L = E + A (C/C0)^-gamma per arch")
    fits = {}
    for a, (C, L) in runs.items():
        try:
            fits[a] = fit.fit_power_law_fixed_E(C, L, ref_fit.E, C0, a)
            lines.append(f"  {a:>12}: A={fits[a].A:.4f} gamma={fits[a].gamma:.4f}")
            out["fits"][a] = fits[a].to_dict()
        except ValueError as e:
            lines.append(f"  {a:>12}: not fitted: {e}")
            out["fits"][a] = {"error": str(e)}
    lines.append(f"[X6] compute multipliers vs {ref} at its measured budgets: measured (interpolated "
                 "between the arch's own points, nan outside them) / from the fitted laws")
    ref_C, ref_L = runs[ref]
    lines.append(f"  {'':>12} " + " ".join(f"{c:>13.3g}" for c in ref_C))
    for a in archs:
        if a == ref:
            continue
        measured = fit.compute_multiplier(ref_C, ref_L, *runs[a])
        fitted = [float("nan")] * len(ref_C)
        if a in fits and ref in fits:
            fitted = [float(ref_fit_c / arm_c) for ref_fit_c, arm_c in
                      zip(fits[ref].compute(fits[ref].loss(ref_C)), fits[a].compute(fits[ref].loss(ref_C)))]
        lines.append(f"  {a:>12} " + " ".join(f"{m:6.3f}/{f:<6.3f}" for m, f in zip(measured, fitted)))
        out["multipliers"][a] = [dict(C=float(c), measured=float(m), fitted=float(f))
                                 for c, m, f in zip(ref_C, measured, fitted)]
    out["points"] = rows
    if plot_path and ref in fits:  # fit.py's power laws + measured multipliers (needs matplotlib)
        fitted_runs = {a: runs[a] for a in fits}
        mult = {a: fit.compute_multiplier(ref_C, ref_L, *runs[a]) for a in fits if a != ref}
        if fit.plot_power_laws(fitted_runs, fits, mult, ref, plot_path):
            lines.append(f"plot: {plot_path}")
    return "\n".join(lines), out


# ----------------------------------------------------------------------------------------------------
# CSV, estimates, the whole ladder


def write_csv(path, rows):
    """Atomic CSV with the union of the rows' keys (first-seen order) as the header."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    buffer = io.StringIO()
    w = csv.DictWriter(buffer, fieldnames=columns)
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r[k]) for k in columns})
    write_atomic(path, lambda f: f.write(buffer.getvalue().encode()))


def planned_compute(preset, specs, world=None):
    """Analytic training FLOPs of the whole ladder (branches: decay tokens only; stable: all steps)."""
    total = 0.0
    tps_model = preset["model"]["block_size"]
    for s in specs:
        tokens_per_step = s.settings.get("batch_size", preset["train"]["batch_size"]) * tps_model * \
            s.settings.get("grad_accum", preset["train"].get("grad_accum", 1)) * (world or world_size())
        if s.role == "branch":
            total += s.meta["F"] * s.settings["decay_tokens"]
        else:
            total += s.meta["F"] * s.settings["max_steps"] * tokens_per_step
    return total


def build(preset, world=None):
    """(specs, cells or None) of a preset."""
    if preset["kind"] == "smelt":
        cells = smelt_cells(preset)
        return smelt_specs(preset, cells), cells
    if preset["kind"] == "x":
        return x_specs(preset, world), None
    raise ValueError(f"preset {preset['name']}: unknown kind {preset['kind']!r}")


def ladder(preset_name, out_dir=None, bootstrap=None, train_fn=None, progress=True, fit_only=False,
           keep_checkpoints=False, plot=False, log=print, **overrides):
    """Run (or continue) a preset end to end; returns the report dict (also OUT/report.json)."""
    preset = get_preset(preset_name, **overrides)
    out_dir = out_dir or os.path.join("out", f"ladder-{preset_name}")
    if "RANK" in os.environ:  # under torchrun: join the process group now, so only rank 0 writes
        train.setup_distributed(preset["train"].get("device", "auto"))
        if not _is_master():
            log = _quiet
    specs, cells = build(preset)
    log(f"preset {preset_name}: {preset['about']}")
    log(f"  {len(specs)} runs, {planned_compute(preset, specs):.3e} training FLOPs planned, output {out_dir}")
    if cells:
        log("\n".join(match_table(cells)[0]))
    if fit_only:
        results = {s.run_id: load_result(out_dir, s) for s in specs}
    else:
        import torch
        saved_threads = torch.get_num_threads()
        if preset.get("threads"):  # tiny CPU models: 1 thread is faster, and far faster on a busy machine
            torch.set_num_threads(preset["threads"])
        try:
            results = run_ladder(specs, out_dir, train_fn=train_fn, progress=progress,
                                 keep_checkpoints=keep_checkpoints, log=log)
        finally:
            torch.set_num_threads(saved_threads)
    if not _is_master():
        return None
    finished = [results[s.run_id] for s in specs if results.get(s.run_id)]
    n_boot = preset.get("bootstrap", 0) if bootstrap is None else bootstrap
    if preset["kind"] == "smelt":
        rows = smelt_rows(finished)
        text, report = smelt_report(preset, cells, rows, n_boot, seed=preset["seed"], progress=progress,
                                    plot_path=os.path.join(out_dir, "frontiers.png") if plot else None)
    else:
        rows = x_rows(finished)
        text, report = x_report(preset, rows, plot_path=os.path.join(out_dir, "power_laws.png") if plot else None)
    report.update(runs_finished=len(finished), runs_total=len(specs),
                  train_seconds=sum(r.get("seconds") or 0.0 for r in finished))
    if len(finished) < len(specs):
        text += f"\n(partial: {len(finished)}/{len(specs)} runs finished)"
    write_csv(os.path.join(out_dir, "runs.csv"), rows)
    write_json_atomic(os.path.join(out_dir, "report.json"), report)
    write_atomic(os.path.abspath(os.path.join(out_dir, "report.txt")), lambda f: f.write((text + "\n").encode()))
    log(text)
    log(f"wrote {os.path.join(out_dir, 'runs.csv')}, report.txt, report.json "
        f"({report['train_seconds']:.0f} s of training in the finished runs)")
    return report


def describe_presets():
    lines = []
    for name, p in PRESETS.items():
        preset = get_preset(name)
        world = world_size(preset)
        try:
            specs, _ = build(preset, world)
            what = f"{len(specs)} runs, {planned_compute(preset, specs, world):.2e} FLOPs"
            if world > 1:
                what += f" on {world} GPUs"
        except ValueError as e:
            what = f"not buildable: {e}"
        lines.append(f"{name:>16}  {what}: {p['about']}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--preset", help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--out", help="output folder (default out/ladder-<preset>)")
    p.add_argument("--bootstrap", type=int, help="cell-bootstrap draws for the SMELT CE Gain (preset default)")
    p.add_argument("--fit-only", action="store_true", help="train nothing; fit and report the finished runs")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the decay branches' final ckpt.pt")
    p.add_argument("--plot", action="store_true", help="OUT/frontiers.png or OUT/power_laws.png (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    p.add_argument("--threads", type=int, help="torch CPU threads while training (preset default; CPU presets "
                                               "use 1: small models gain little from 2, and lose 10x on a busy machine)")
    p.add_argument("--list", action="store_true", help="list the presets with their size")
    args = p.parse_args(argv)
    if args.list:
        print(describe_presets())
        return 0
    if not args.preset:
        p.error("give --preset (or --list)")
    try:
        ladder(args.preset, out_dir=args.out, bootstrap=args.bootstrap, progress=not args.no_progress,
               fit_only=args.fit_only, keep_checkpoints=args.keep_checkpoints, plot=args.plot, threads=args.threads)
    except (ValueError, FileNotFoundError, train.NonFiniteLoss) as e:
        print(f"ladder.py: error: {e}", file=sys.stderr)
        return 1
    finally:
        if "RANK" in os.environ:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
