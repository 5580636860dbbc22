"""
Weights apart from the run that trained them: held against the model config they come with, and the export
folder that shares them (python -m tooling.export writes it) read back.

  check_weights  the names, shapes and dtypes of the model a config builds (on the meta device: no memory)
                 against stored weights, and their finiteness, before anything is built: every checkpoint
                 (tooling/checkpoint.py) and every export is checked so.
  DIR/           an export, as the ecosystem shares weights:
    model.safetensors  every tensor once: a tied alias (lm_head.weight, when it is wte.weight) is left out,
                       named in the header's metadata as safetensors' save_model names it, and restored on load
    config.json        {"format", "model_config" (the ModelConfig), "tokenizer", "trained" (step, tokens seen,
                       the last val loss), "sha256" (of model.safetensors, whose header repeats the rest)}
    README.md          what the weights are, in words

Trust: safetensors holds a JSON header and raw tensor bytes (reading it runs no code), config.json is JSON;
only these fixed names inside the folder are read, each a regular file. No bit changes unnoticed: the weights
file must have the SHA-256 config.json records, and its header holds config.json's other fields, which must
be config.json's.
"""

import hashlib
import json
import os

import torch

from model import GPT, ModelConfig
from tooling import distributed, legacy
from tooling.common import check_regular, first_line

EXPORT_FORMAT = "loopstudy-export-1"
WEIGHTS_FILE, CONFIG_FILE, README_FILE = "model.safetensors", "config.json", "README.md"
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few kB: anything larger is not one
SEALED_KEY = "loopstudy_config"  # the weights file's header repeats config.json's fields but its sha256
SEALED_FIELDS = ("format", "model_config", "tokenizer", "trained")
# what config.json's "trained" may hold, with the types each value has (or null)
TRAINED_FIELDS = {"step": (int,), "tokens_seen": (int,), "val_loss": (int, float), "val_bpb": (int, float),
                  "run_name": (str,)}


# ----------------------------------------------------------------------------------------------------
# Weights against their config


def finite_flags(tensors, collective=False):
    """One flag per tensor (a loaded checkpoint's, to name the first that is not): its values (this rank's
    shard; with collective, every rank's) are all finite. One reduction on the tensors' device, one host read."""
    tensors = [distributed.local(t) for t in tensors]
    if not tensors:
        return []
    flags = torch.stack([torch.isfinite(t).all() for t in tensors]).float()  # integer tensors: always finite
    if collective:
        distributed.all_reduce(flags, op="min")
    return [bool(f) for f in flags.tolist()]


def non_finite(path, name):
    """The line refusing a checkpoint whose weight `name` holds NaN or inf."""
    return (f"{path}: weight {name} holds NaN or inf (training never writes such weights): refused; use another "
            "checkpoint")


def check_weights(path, model_config, weights):
    """Refuse, before anything is built, weights that do not fit the model config stored with them: the
    names, shapes and dtypes of the model it configures (built on the meta device: no memory) against
    `weights` (tensors, or meta tensors of a ckpt.dcp/'s shapes), the buffers it would allocate, and
    non-finite values. One line naming the first tensor that differs."""
    differ = f"{path}: the weights do not match the model config stored with them"
    try:
        config = ModelConfig.from_dict(model_config)
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: its model_config is not valid: {first_line(e)}") from None
    if not isinstance(weights, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in weights.items()):
        raise ValueError(f"{differ}: 'model' is not a dict of named tensors")
    blocks = {k.split(".")[1] for k in weights if k.startswith("blocks.")}
    missing = next((i for i in range(config.n_blocks) if str(i) not in blocks), None)
    if missing is not None:  # checked before building: thousands of blocks take minutes even on the meta device
        raise ValueError(f"{differ}: the config has {config.n_blocks} blocks, the weights {len(blocks)} "
                         f"(blocks.{missing}.* is missing)")
    try:
        with torch.device("meta"):
            model = GPT(config)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: its model_config is not valid: {first_line(e)}") from None
    expected = model.state_dict()
    for name in [*expected, *(k for k in weights if k not in expected)]:
        stored, wanted = weights.get(name), expected.get(name)
        if stored is None:
            raise ValueError(f"{differ}: {name} is missing")
        if wanted is None:
            raise ValueError(f"{differ}: {name} is not a weight of that model")
        if stored.shape != wanted.shape:
            raise ValueError(f"{differ}: {name} is stored with shape {list(stored.shape)}, the config's model has "
                             f"{list(wanted.shape)}")
        if stored.dtype != wanted.dtype:
            raise ValueError(f"{differ}: {name} is stored as {stored.dtype}, the model's weights are {wanted.dtype}")
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    size = sum(t.numel() * t.element_size() for t in weights.values())
    if buffers > max(size, 1 << 30):  # RoPE tables: block_size rows
        raise ValueError(f"{differ}: block_size={config.block_size} needs {buffers / 2**30:.0f} GiB of RoPE tables "
                         f"beside {size / 2**20:.0f} MB of weights")
    stored = {k: t for k, t in weights.items() if not t.is_meta and t.is_floating_point()}
    bad = next((k for k, finite in zip(stored, finite_flags(stored.values())) if not finite), None)
    if bad is not None:
        raise ValueError(non_finite(path, bad))


# ----------------------------------------------------------------------------------------------------
# The export folder read back


def is_export(path):
    """True for a folder holding an export's weights or config (a folder that is neither is no export)."""
    return os.path.isdir(path) and any(os.path.lexists(os.path.join(path, name))
                                       for name in (WEIGHTS_FILE, CONFIG_FILE))


def tied_names(model):
    """{alias: name} of the parameters a model holds under two names (a tied lm head: {"lm_head.weight":
    "wte.weight"}); the first name in the model's order is the one kept."""
    first, aliases = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def config_ties(model_config):
    """The ties a model of this config has (GPT ties only its lm head to the embedding)."""
    return {"lm_head.weight": "wte.weight"} if model_config.get("tie_embeddings") else {}


def sealed_config(config):
    """config.json's fields but its sha256, as the JSON text the weights file's header holds (under SEALED_KEY):
    the weights' SHA-256 in config.json covers that header, so neither file can change unnoticed."""
    return json.dumps({k: config.get(k) for k in SEALED_FIELDS}, sort_keys=True, allow_nan=False)


def file_sha256(path):
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            sha.update(block)
    return sha.hexdigest()


def export_file(path, name):
    """path/name, refused in one line unless it is a regular file (no pipe or device behind a symlink)."""
    file = os.path.join(path, name)
    if not os.path.lexists(file):
        raise ValueError(f"{path}: an export folder without {name} (python -m tooling.export writes "
                         f"{WEIGHTS_FILE}, {CONFIG_FILE} and {README_FILE})")
    check_regular(file, "export file")
    return file


def read_export_config(path):
    """An export's config.json, checked: its format, the keys and types it must have, a valid ModelConfig ->
    (config, its sealed_config text as read)."""
    file = export_file(path, CONFIG_FILE)
    with open(file, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(f"{file} is over {MAX_CONFIG_BYTES >> 20} MB: not an export's config")
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: malformed JSON ({first_line(e)})") from None
    if not isinstance(config, dict) or config.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{file} is not the config of a loopstudy export (format {EXPORT_FORMAT!r} expected)")
    for key, kinds in (("model_config", dict), ("sha256", str), ("trained", dict)):
        if not isinstance(config.get(key), kinds):
            raise ValueError(f"{file}: {key!r} is missing or not a {kinds.__name__}")
    if config.get("tokenizer") is not None and not isinstance(config["tokenizer"], str):
        raise ValueError(f"{file}: 'tokenizer' must be a tokenizer name or null")
    for key, value in config["trained"].items():
        kinds = TRAINED_FIELDS.get(key)
        if kinds is None or not (value is None or (isinstance(value, kinds) and not isinstance(value, bool))):
            raise ValueError(f"{file}: trained.{key}={value!r} is not one of {sorted(TRAINED_FIELDS)} with its type")
    sealed = sealed_config(config)
    try:  # a config of an earlier release in this one's fields, as a checkpoint's is (tooling/legacy.py)
        config["model_config"] = legacy.upgraded({"model_config": config["model_config"]}, file)["model_config"]
        ModelConfig.from_dict(config["model_config"])
    except (TypeError, ValueError, AttributeError) as e:  # (legacy's line names the file itself)
        raise ValueError(f"{file}: its model_config is not valid: {first_line(e).removeprefix(file + ': ')}") \
            from None
    return config, sealed


def read_safetensors(file):
    """({name: tensor} on the CPU, the header's metadata) of a safetensors file."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ValueError(f"reading {file} needs safetensors: pip install -r requirements-eval.txt") from None
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}
    except Exception as e:  # safetensors' own error type for a malformed header or a short file
        raise ValueError(f"cannot read {file} (truncated, or not a safetensors file): {first_line(e)}") from None


def load_exported_state(path):
    """The contents of an export folder, checked as a checkpoint is, for a new training run from its weights
    (train.py --init_from DIR) -> (model_config, state_dict, info):
      model_config  dict of ModelConfig fields (what a checkpoint's "model_config" holds)
      state_dict    {name: CPU tensor}: exactly model.GPT(ModelConfig(**model_config)).state_dict()'s names,
                    shapes and dtypes, all finite, a tied alias restored as the same tensor as its twin
      info          config.json's "tokenizer" and "trained" (step, tokens_seen, val_loss, val_bpb, run_name;
                    each may be null), its "format" and "sha256", and "path"
    An export carries no optimizer state, schedule position or data position: a run from it starts at step 0
    with a fresh optimizer (info's step and tokens are provenance). Mistakes raise ValueError in one line
    naming the file: no folder, a file missing, config.json malformed or missing keys, weights corrupt (their
    SHA-256), unreadable, or not the model the config describes (names, shapes, dtypes, NaN/inf)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"export folder not found: {path}")
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not an export folder (python -m tooling.export writes one)")
    config, sealed = read_export_config(path)
    weights_file = export_file(path, WEIGHTS_FILE)
    if file_sha256(weights_file) != config["sha256"]:
        raise ValueError(f"{weights_file} does not have the bytes it was written with (its SHA-256 differs from "
                         f"the one {CONFIG_FILE} records: the file is corrupt); export it again")
    state, metadata = read_safetensors(weights_file)
    if metadata.get(SEALED_KEY) != sealed:
        raise ValueError(f"{os.path.join(path, CONFIG_FILE)} differs from the config sealed in {WEIGHTS_FILE}'s "
                         "header (edited or corrupt): refused; export it again")
    for alias, name in config_ties(config["model_config"]).items():
        if alias in state:
            raise ValueError(f"{weights_file} holds both {alias} and {name}, which the config ties: a tied "
                             "weight is stored once")
        if name in state:
            state[alias] = state[name]
    check_weights(weights_file, config["model_config"], state)
    info = {key: config.get(key) for key in ("format", "tokenizer", "trained", "sha256")}
    info["path"] = path
    return config["model_config"], state, info


def load_exported(path):
    """A model.GPT from an export folder -> (model on the CPU, info); info as load_exported_state's, plus
    "model_config" and the step and tokens seen as "state" (the keys the tools read from a checkpoint)."""
    model_config, state, info = load_exported_state(path)
    model = GPT(ModelConfig.from_dict(model_config))
    model.load_state_dict(state)
    trained = info["trained"]
    info.update(model_config=model_config, state={"step": trained.get("step"),
                                                  "tokens_seen": trained.get("tokens_seen")})
    return model, info
