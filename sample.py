"""
Sample text from a checkpoint (nanoGPT's sample.py), at any number of test-time
passes; or export its weights.

    python sample.py --ckpt out/tiny/ckpt.pt --start "ROMEO:" --num_samples 2
    python sample.py --ckpt out/tiny/ckpt.pt --start FILE:prompt.txt --n_passes 3
    python sample.py --ckpt out/tiny/ckpt.pt --export out/tiny/export

--n_passes K runs a looped model with K passes (the core passes of "pcc", the
loop count r of "smelt" and "layer_loop"). Every tool's --ckpt also reads an export;
with model.py alone it loads as (a tied head restored):

    model = GPT(ModelConfig(**json.load(open("DIR/config.json"))["model_config"]))
    safetensors.torch.load_model(model, "DIR/model.safetensors")
"""
import argparse
import json
import os
import shutil
import sys

import torch

from data.loader import get_tokenizer
from model import execution_plan, load_checkpoint

SEPARATOR = "---------------"


def check_n_passes(config, n_passes):
    """ValueError unless a model of config runs n_passes passes (None: as trained)."""
    if n_passes is not None and config.layout == "plain":
        raise ValueError(f"n_passes={n_passes}: a plain model has nothing to loop")
    # An untied model runs at most the cores it has.
    execution_plan(config, n_passes)


@torch.no_grad()
def generate_windowed(
    model, idx, max_new_tokens, temperature=1.0, top_k=None, n_passes=None, generator=None
):
    """model.generate for any length: idx (B, T) -> the new ids (B, max_new_tokens)."""
    block_size, context, new, left = model.config.block_size, idx, [idx[:, :0]], max_new_tokens
    while left > 0:
        # A full context keeps its last block_size // 2 tokens as the next prompt.
        if context.size(1) >= block_size:
            context = context[:, -(block_size // 2):]
        # Each call fills the context up to block_size.
        n = min(left, block_size - context.size(1))
        context = model.generate(context, n, temperature, top_k, n_passes, generator)
        new, left = new + [context[:, -n:]], left - n
    return torch.cat(new, dim=1)


def sample_texts(
    model,
    tokenizer,
    start="",
    num_samples=1,
    max_new_tokens=200,
    temperature=0.8,
    top_k=200,
    seed=1337,
    n_passes=None,
):
    """num_samples texts, each the prompt and its continuation; seeded."""
    check_n_passes(model.config, n_passes)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    # Every prompt starts with <|endoftext|>, as every training document does.
    prompt = torch.tensor([[tokenizer.eot_token] + tokenizer.encode(start)], device=device)
    was_training = model.training
    # Sampling leaves the model's mode as it found it.
    model.eval()
    texts = []
    for _ in range(num_samples):
        # On a GPU the model runs in bfloat16, as it was trained.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            new = generate_windowed(
                model, prompt, max_new_tokens, temperature, top_k, n_passes, generator
            )
        ids = prompt[0, 1:].tolist() + new[0].tolist()
        # A vocabulary padded beyond the tokenizer's has ids without text.
        texts.append(tokenizer.decode([i for i in ids if i < tokenizer.n_vocab]))
    model.train(was_training)
    return texts


# model.safetensors, config.json and README.md, into the new folder out.
def export(model, info, out):
    from safetensors.torch import save_model
    # Written into a temporary folder, renamed into place when complete.
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        # save_model stores a tied weight once, naming both in the header.
        save_model(model, os.path.join(tmp, "model.safetensors"))
        config = dict(
            model_config=model.config.to_dict(), tokenizer=info["tokenizer"], step=info.get("step")
        )
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(tmp, "README.md"), "w") as f:
            f.write(readme(model, config, os.path.basename(out.rstrip("/"))))
        os.replace(tmp, out)
    finally:
        # Nothing half-written is left.
        shutil.rmtree(tmp, ignore_errors=True)


# The model card of an export.
def readme(model, config, name):
    cfg, params = model.config, model.num_params()
    if cfg.layout == "plain":
        passes = "plain: nothing loops"
    else:
        passes = f"trained with {cfg.n_passes}; `--n_passes K` runs 1 to {cfg.most_passes}"
    if cfg.n_expert:
        ffn = f"{cfg.n_expert} experts, top-{cfg.top_k}"
    else:
        ffn = f"dense SwiGLU {cfg.mlp_hidden}"
    return f"""# {name}: loopstudy weights

A `model.GPT` of loopstudy (looped and MoE transformers, one file: model.py).

- layout `{cfg.layout}`, {cfg.n_layer} layers of width {cfg.n_embd}, {cfg.n_head} heads, {ffn}
- passes: {passes}
- {params['total']:,} parameters, {params['active']:,} active per token
- context {cfg.block_size} tokens, tokenizer `{config['tokenizer']}`, step {config['step']}

```bash
python sample.py --ckpt {name} --start "ROMEO:"
python eval_harness.py --ckpt {name} --tasks hellaswag --n_passes 1,2,4
```

```python
from model import load_checkpoint
model, info = load_checkpoint("{name}")  # or safetensors' load_model on a GPT(ModelConfig)
```
"""


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="sample.py", usage=argparse.SUPPRESS, description=__doc__.split("\n\n")[0].strip()
    )
    p.add_argument("--ckpt", default="out/tiny/ckpt.pt", help="a ckpt.pt or an export folder")
    p.add_argument("--start", default="", help="the prompt, or FILE:path to read it from a file")
    p.add_argument("--num_samples", type=int, default=3)
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top_k", type=int, default=200)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument(
        "--n_passes", type=int, default=None, help="test-time passes (default: as trained)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # --export writes the weights instead of sampling.
    p.add_argument(
        "--export", metavar="DIR", help="write the weights as safetensors into DIR instead"
    )
    args = p.parse_args(argv)
    # An export never overwrites a folder.
    if args.export and os.path.exists(args.export):
        p.error(f"--export {args.export} exists: give a new folder")
    try:
        # FILE:path reads the prompt from a UTF-8 file.
        start = args.start
        if start.startswith("FILE:"):
            with open(start[5:], encoding="utf-8") as f:
                start = f.read()
        # An export needs no accelerator.
        model, info = load_checkpoint(args.ckpt, "cpu" if args.export else args.device)
        check_n_passes(model.config, args.n_passes)
    except (OSError, ValueError, RuntimeError) as e:
        # A missing or bad file, a bad value or --device: one line, not a traceback.
        p.error(str(e).splitlines()[0])
    if args.export:
        export(model, info, args.export)
        print(f"exported {args.ckpt} to {args.export}/ (model.safetensors, config.json, README.md)")
        return 0
    # Each sample is printed with a separator line after it.
    tokenizer = get_tokenizer(info["tokenizer"])
    texts = sample_texts(
        model,
        tokenizer,
        start,
        args.num_samples,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.seed,
        args.n_passes,
    )
    for text in texts:
        print(text + "\n" + SEPARATOR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
