"""What every protocol uses: the data a preset reads, a step's tokens, N (compute-active parameters), a
ModelConfig as train.py settings, the swept LR, the validation sources, and numbers for a report."""

import os
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

import grow
import match
from tooling import common
import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: config/, docs/ladder/


@dataclass
class DataPlan:
    """Where a preset's data is and how big its regions are (None when it is not prepared here)."""
    data_dir: str
    train_tokens: Optional[int] = None  # the train split
    stable_tokens: Optional[int] = None  # what a stable run reads (the split minus the held-back tail)
    branch_tokens: Optional[int] = None  # the held-back tail that decay branches read


def data_plan(preset, prepare=True):
    """The preset's data: the embedded corpus in the preset's tokenizer (prepared once, offline) or
    the train data_dir it names (GPU presets: their sizes are unknown until it is prepared)."""
    from data import prepare as prep
    if preset.tokenizer:
        out = os.path.join(prep.DATA_DIR, "cache", f"default-{preset.tokenizer}")
        data_dir = prep.prepare_default(out, tokenizer=preset.tokenizer, verbose=False) if prepare else out
    else:
        data_dir = preset.train.get("data_dir", "")
    try:
        n = int(prep.load_meta(data_dir or prep.DEFAULT_OUT)["splits"]["train"]["tokens"])
    except (FileNotFoundError, ValueError):
        return DataPlan(data_dir)
    held = int(n * preset.train.get("branch_data_fraction", train.DEFAULTS["branch_data_fraction"]))
    return DataPlan(data_dir, n, n - held, held)


def compute_active(cfg):
    """N: the non-embedding parameters one token's compute runs through ([X10]'s N_c without the lm
    head): every executed block's matmul weights, once per visit, the active experts only."""
    return match.accounting(cfg)["params_compute_active"] - cfg.vocab_size * cfg.n_embd


def tokens_per_step(preset, world=None):
    t = preset.train
    sequences = t.get("global_batch") or t["batch_size"] * (world or world_size(preset))
    return sequences * preset.model["block_size"]


def world_size(preset=None):
    """DDP processes (torchrun sets WORLD_SIZE): a step reads global_batch (or batch_size x world) sequences.
    Outside torchrun a preset's intended `gpus` is used for planning only (--list)."""
    if "WORLD_SIZE" in os.environ or preset is None:
        return int(os.environ.get("WORLD_SIZE", "1"))
    return int(preset.gpus)


LR_KEYS = ("matrix_lr", "embedding_lr", "unembedding_lr")  # an [X] model has no router or norm gains


def lr_scaling(n_params, anchor_params, beta):
    """[X16] GLR(N) = GLR_anchor * (N / N_anchor)^beta, as a multiplier on every LR."""
    return (n_params / anchor_params) ** beta


def carried_lrs(settings, cfg, anchor_params, beta):
    """settings with every LR (train.py's default where unset) x [X16]'s multiplier for the model cfg
    (N = its stored parameters at initialisation, token embedding included, as the [X] code)."""
    scale = lr_scaling(grow.stored_params(cfg), anchor_params, beta)
    lrs = {k: settings.get(k) or train.DEFAULTS[k] for k in LR_KEYS}
    lrs["matrix_lr"] = train.matrix_lr(settings.get("optimizer", train.DEFAULTS["optimizer"]), lrs["matrix_lr"])
    return dict(settings, **{k: v * scale for k, v in lrs.items()})


def model_settings(cfg):
    """ModelConfig -> train.py model overrides (the resolved fields as plain ints, so the run is fully
    specified and JSON-stable), but a loop span outside a loop layout (train.py refuses a setting that does
    nothing: guards.check_inert) and what a run takes from its data (train.FROM_DATA: eot_token, n_logits)."""
    inert = set(train.FROM_DATA) | (set() if cfg.layout in ("smelt", "layer_loop") else {"loop_span"})
    return {k: (int(v) if isinstance(v, int) and not isinstance(v, bool) else v) for k, v in asdict(cfg).items()
            if k not in inert}


def sweep_values(preset):
    """(the swept setting, its values), or (None, [None]) without a sweep."""
    sweep = preset.lr_sweep
    return (sweep.key, sweep.values) if sweep else (None, [None])


def sweep_point(preset, arch, depth=None):
    """What one LR sweep tunes (best_lrs' keys): an architecture, its value carried up the ladder, or with
    lr_sweep.at_every_depth an (architecture, depth) ladder point, each with its own value."""
    return (arch, depth) if preset.lr_sweep and preset.lr_sweep.at_every_depth else arch


def grid_limits(values, extend):
    """(ratio, lo, hi) of a bracketed grid (values `ratio` apart, an LR or a weight decay): a best value at lo
    or below, or hi or above, is at the bracketing limit (`extend` steps beyond the grid); nothing beyond it
    runs."""
    ratio = values[1] / values[0] if len(values) > 1 else 1.0  # one value: it is the limit
    return ratio, values[0] / ratio ** (extend - 0.5), values[-1] * ratio ** (extend - 0.5)


def sweep_limits(preset):
    """grid_limits of a preset's LR sweep."""
    return grid_limits(preset.lr_sweep.values, preset.lr_sweep.extend)


def swept_value(spec, key):
    """A sweep run's value of the swept LR as the grid names it (before [X16] scales it at another depth)."""
    return spec.meta.get("lr", spec.settings[key])


def sources_of(results):
    """The validation sources (val_loss_by_source's keys) of finished runs, in order of appearance."""
    names = []
    for r in results:
        for k in (r.get("val_loss_by_source") or {}):
            if k not in names:
                names.append(k)
    return names


def sources_of_rows(rows):
    return [k[len("loss_"):] for k in (rows[0] if rows else {}) if k.startswith("loss_")]


def finite_or_none(v):
    """float, or None for a missing / non-finite value (JSON has no inf or nan)."""
    return None if v is None or not np.isfinite(float(v)) else float(v)


def fmt(v, spec):
    """A report's number: format(v, spec), or "undefined" for a missing / non-finite value."""
    return common.fmt(v, spec, missing="undefined")
