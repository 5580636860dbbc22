"""
Share a checkpoint's weights as the ecosystem does: safetensors, a config.json and a README.

    python -m tooling.export out/tiny/ckpt.pt --out out/tiny/export
    python sample.py --ckpt out/tiny/export --start "ROMEO:"     # every tool's --ckpt reads the folder back
    python eval_harness.py --ckpt out/tiny/export --tasks arc_easy

The folder (its format, and how it is read back and checked: tooling/weights.py):
    model.safetensors  the weights, each tensor once: a tied lm head is stored as wte.weight alone, the
                       header's metadata naming the dropped alias ({"lm_head.weight": "wte.weight"}, as
                       safetensors.torch.save_model names what it drops) and the loader restoring it
    config.json        the ModelConfig, the tokenizer, what training saw, the SHA-256 of model.safetensors (whose
                       header repeats the rest: neither file changes unnoticed)
    README.md          what the weights are: layout, passes, tokenizer, tokens seen, the final val loss

It is written into a temp folder beside --out, read back and compared with the source tensor by tensor,
then renamed into place: a failure at any moment leaves no half-written export. From Python:

    from tooling.export import load_exported, load_exported_state
    model, info = load_exported("out/tiny/export")
    model_config, state_dict, info = load_exported_state("out/tiny/export")   # a new run from the weights
"""

import json
import math
import os
import shutil
import sys
import tempfile

import torch

from model import most_passes
from tooling import rundir
from tooling.checkpoint import load_model, plain_config
from tooling.common import TEMP_MARK, cli_error, current_umask, parser
from tooling.weights import (CONFIG_FILE, EXPORT_FORMAT, README_FILE, SEALED_KEY, WEIGHTS_FILE, file_sha256, is_export,
                             load_exported, load_exported_state, sealed_config, tied_names)

__all__ = ["export", "load_exported", "load_exported_state", "write_export", "main"]
PROG = "tooling.export"


def trained_from(ckpt):
    """What the weights saw: step, tokens, the last eval's val loss, the run's name (from a checkpoint's
    TrainState and settings, or an export's own "trained"); non-finite numbers as null."""
    if isinstance(ckpt.get("trained"), dict):  # an export, exported again
        trained = dict(ckpt["trained"])
    else:
        state, settings = ckpt.get("state") or {}, ckpt.get("train_config") or {}
        last = state.get("last_eval") or {}
        trained = {"step": state.get("step"), "tokens_seen": state.get("tokens_seen"),
                   "val_loss": last.get("val_loss"), "val_bpb": last.get("val_bpb"),
                   "run_name": settings.get("run_name") or None}
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in trained.items()}


def write_export(model, ckpt, directory, name):
    """model.safetensors, config.json and README.md of `model` (and the provenance in `ckpt`, the checkpoint
    dict it came from) into `directory`, an empty folder; `name`: what the README calls the folder."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ValueError("exporting needs safetensors: pip install -r requirements-eval.txt") from None
    ties = tied_names(model)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k not in ties}
    weights = os.path.join(directory, WEIGHTS_FILE)
    config = {"format": EXPORT_FORMAT, "model_config": plain_config(model.config),
              "tokenizer": ckpt.get("tokenizer"), "trained": trained_from(ckpt)}
    # "format": "pt" as the ecosystem writes it; each dropped alias as save_model names it; config.json sealed
    save_file(tensors, weights, metadata={"format": "pt", **ties, SEALED_KEY: sealed_config(config)})
    config["sha256"] = file_sha256(weights)
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, allow_nan=False)
        f.write("\n")
    with open(os.path.join(directory, README_FILE), "w", encoding="utf-8") as f:
        f.write(readme_text(model, config, ties, name))
    for file in (WEIGHTS_FILE, CONFIG_FILE, README_FILE):  # the permissions any new file gets (safetensors: 0600)
        os.chmod(os.path.join(directory, file), 0o666 & ~current_umask())


def layout_words(cfg):
    """The depth layout in one phrase."""
    if cfg.layout == "plain":
        return f"plain: {cfg.n_layer} layers, each run once"
    r = cfg.n_passes
    if cfg.layout in ("smelt", "layer_loop"):
        first, last = cfg.loop_start, cfg.loop_start + cfg.loop_span - 1
        how = "the span run again whole, SMELT's model-loop" if cfg.layout == "smelt" else \
            "each layer repeated in place, the layer-loop"
        return (f"{cfg.layout}: {cfg.n_layer} layers, layers {first}-{last} executed {r} times ({how}), every "
                f"update inside scaled by 1/{r}")
    cores = "one tied core applied" if cfg.tie_core else "untied cores, one per pass, applied"
    return (f"prelude-core-coda {cfg.n_prelude}/{cfg.n_core}/{cfg.n_coda}: {cores} {r} times, boundary operator "
            f"{cfg.boundary!r} (alpha {cfg.boundary_alpha:g})")


def passes_words(cfg):
    """What --n_passes may ask of this model at test time."""
    if cfg.layout == "plain":
        return "none: nothing loops"
    limit = most_passes(cfg)
    why = " (one stored core per pass)" if limit == cfg.n_passes else ""
    return f"trained with {cfg.n_passes}; `--n_passes K` runs K = 1 to {limit}{why}"


def readme_text(model, config, ties, name):
    """The export's README.md: what the weights are, and how to use them."""
    cfg, trained, counts = model.config, config["trained"], model.num_params()
    ffn = f"MoE: {cfg.n_expert} experts of hidden {cfg.expert_hidden}, top-{cfg.top_k}" if cfg.n_expert else \
        f"dense SwiGLU, hidden {cfg.mlp_hidden}"
    tokenizer = config["tokenizer"] or "not recorded: give the tools --tokenizer"
    if (config["tokenizer"] or "").startswith("gpt2"):
        tokenizer += " (GPT-2 BPE, tiktoken; loopstudy's data/tokenizer.py builds it offline)"
    step, tokens, loss, bpb = (trained.get(k) for k in ("step", "tokens_seen", "val_loss", "val_bpb"))
    seen = f"step {step}, {tokens:,} tokens" if step is not None and tokens is not None else "not recorded"
    val = "not recorded" if loss is None else f"{loss:.4f} nats per token" + \
        (f" ({bpb:.4f} bits per byte)" if bpb is not None else "") + ", at the last eval"
    rows = [("layout", layout_words(cfg)),
            ("width", f"n_embd {cfg.n_embd}; {cfg.n_head} query / {cfg.n_kv_head} KV heads of {cfg.head_dim}"),
            ("feed-forward", ffn),
            ("context", f"{cfg.block_size} tokens; vocabulary {cfg.vocab_size}, <|endoftext|> = {cfg.eot_token} "
                        "(every document starts with it)"),
            ("parameters", f"{counts['total']:,} stored, {counts['active']:,} active per token"),
            ("test-time passes", passes_words(cfg)), ("tokenizer", tokenizer),
            ("trained", seen), ("final val loss", val)]
    tie = f"; {', '.join(f'{a} is {b}' for a, b in ties.items())} (stored once, restored on load)" if ties else ""
    title = trained.get("run_name") or name
    return "\n".join([
        f"# {title}: loopstudy weights", "",
        "A model.GPT of loopstudy (a reference implementation of looped and MoE transformers).", "",
        "| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows), "",
        "## Files", "",
        f"- `{WEIGHTS_FILE}`: the weights, {str(next(model.parameters()).dtype).removeprefix('torch.')}{tie}.",
        f"- `{CONFIG_FILE}`: `model_config` (the ModelConfig), `tokenizer`, `trained` (step, tokens seen, the "
        f"last val loss), `sha256` of `{WEIGHTS_FILE}` (checked on load).", "",
        "## Use", "", "```bash",
        f"python sample.py --ckpt {name} --start \"ROMEO:\"",
        f"python eval_harness.py --ckpt {name} --tasks hellaswag,arc_easy --n_passes 1,2,4",
        f"python train.py --init_from={name}    # a new run from these weights: step 0, a fresh optimizer",
        "```", "", "```python",
        "from tooling.export import load_exported",
        f"model, info = load_exported(\"{name}\")    # model.GPT on the CPU, checked against config.json",
        "```", ""])


def check_target(out, overwrite):
    """Refuse an --out that holds anything but an export to replace (with overwrite) or nothing at all."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file: give a folder for the export")
    if os.path.isdir(out) and os.listdir(out):
        if not overwrite:
            raise ValueError(f"--out {out} already exists: give a new folder, or --overwrite to replace the export "
                             "there")
        if not is_export(out):
            raise ValueError(f"--out {out} holds files that are not an export: refused (--overwrite replaces only an "
                             "export)")


def check_round_trip(model, directory):
    """The export read back (with every check a tool makes) must hold exactly the model's tensors."""
    loaded, _ = load_exported(directory)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        if not torch.equal(a.cpu(), b):
            raise ValueError(f"the export in {directory} did not read back as written ({name} differs): not placed")


def place(tmp, out):
    """Rename the finished export into place; an export already there goes only once the new one is in."""
    if not os.path.lexists(out) or not os.listdir(out):
        os.replace(tmp, out)
        return
    parent, name = os.path.split(out)
    old = os.path.join(parent, f".{name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def export(source, out, overwrite=False):
    """Export the checkpoint (or export folder) at `source` into the folder `out`, atomically: written into a
    temp folder beside it, read back and compared, then renamed into place. -> out (absolute)."""
    out = os.path.abspath(out)
    check_target(out, overwrite)  # before the checkpoint is read: a mistake costs nothing
    model, ckpt = load_model(source)
    parent, name = os.path.split(out)
    os.makedirs(parent, exist_ok=True)
    # into a run folder (out/tiny/export): its lock, so no training writes there or cleans up the temp folder
    with rundir.run_folder_held(out, "write the export elsewhere with --out"):
        tmp = tempfile.mkdtemp(dir=parent, prefix=f".{name}{TEMP_MARK}")
        try:
            os.chmod(tmp, 0o777 & ~current_umask())  # what a new folder gets, not mkdtemp's 0700
            write_export(model, ckpt, tmp, name)
            check_round_trip(model, tmp)
            place(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def main(argv=None):
    p = parser(PROG, description="Export a loopstudy checkpoint as model.safetensors + config.json + README.md "
                                 "(see the module docstring).")
    p.add_argument("ckpt", help="a checkpoint train.py or grow.py wrote (ckpt.pt), or an export folder")
    p.add_argument("--out", required=True, help="the export folder to write (new, empty, or --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an export already in --out, once the new one is complete (default: refuse)")
    args = p.parse_args(argv)
    try:
        out = export(args.ckpt, args.out, args.overwrite)
    except (OSError, ValueError) as e:
        return cli_error(PROG, e)
    print(f"exported {args.ckpt} -> {out}/ ({WEIGHTS_FILE}, {CONFIG_FILE}, {README_FILE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
