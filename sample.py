"""
Sample text from a trained loopstudy checkpoint (nanoGPT's sample.py for our checkpoints).

    python sample.py --ckpt out/tiny/ckpt.pt --start "ROMEO:" --num_samples 3 --max_new_tokens 200 \\
        --temperature 0.8 --top_k 200 --seed 1337
    python sample.py --ckpt out/tiny/ckpt.pt --start FILE:prompt.txt     # the prompt is the file's text
    python sample.py --ckpt out/tiny/ckpt.pt --n_passes 3                # a looped model, 3 loops at test time

- Every prompt is preceded by <|endoftext|> (the model's eot_token), as every training document is, so
  the default --start "" samples a fresh document from its very first token.
- --n_passes K runs a looped model with more or fewer passes than it was trained with: the core passes
  K of layout "pcc", the loop count r of "smelt" / "layer_loop". An untied pcc model has one core per
  trained pass and cannot run more. A plain model has nothing to loop.
- Any --max_new_tokens works: GPT.generate needs prompt + new tokens <= block_size, so generation goes
  in windows; whenever the context is full, its last block_size // 2 tokens become the next prompt
  (positions restart at 0 there, as they do in a model that only ever saw block_size tokens).
- --temperature 0 is greedy decoding. Samples go to stdout, each followed by a line of dashes; the same
  --seed gives the same text.

From Python (an in-memory model, e.g. at the end of training):

    from sample import sample_text
    print(sample_text(model, get_tokenizer("gpt2-4096"), start="ROMEO:", max_new_tokens=100))
"""
import sys

import torch

from tooling import common
from tooling.common import cli_error, number, resolve_device
from data.tokenizer import get_tokenizer
from model import MAX_PASSES, PASSES_WHY, execution_plan
from tooling.checkpoint import load_model

SEPARATOR = "---------------"
LOOPED_LAYOUTS = ("smelt", "layer_loop", "pcc")
# The most a user may ask for, each with its reason (passes: model.MAX_PASSES)
MAX_SAMPLES, SAMPLES_WHY = 1000, "samples run one after another, each printed whole"
MAX_NEW_TOKENS, TOKENS_WHY = 1_000_000, "over all samples: one forward of the model per new token"
MAX_PROMPT_CHARS = 1 << 20  # a prompt of block_size tokens or more is cut to its last block_size // 2 anyway


def read_start(start):
    """The prompt text: `start` itself, or the contents of the file named after 'FILE:'."""
    if not start.startswith("FILE:"):
        return start
    path = start[len("FILE:"):]
    try:
        common.check_regular(path, "prompt file")
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_PROMPT_CHARS + 1)
    except OSError as e:
        raise ValueError(f"cannot read prompt file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"prompt file {path} is not UTF-8 text") from None
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(f"prompt file {path} is over {MAX_PROMPT_CHARS:,} characters: the model reads only its last "
                         "block_size // 2 tokens; give the end of it")
    return text


def check_settings(num_samples, max_new_tokens, temperature, top_k, n_passes):
    """ValueError naming the first sampling setting out of range."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not temperature >= 0:  # also catches nan
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if n_passes is not None and n_passes < 1:
        raise ValueError(f"n_passes must be >= 1, got {n_passes}")
    if num_samples > MAX_SAMPLES:
        raise ValueError(f"num_samples={num_samples}: at most {MAX_SAMPLES:,} ({SAMPLES_WHY})")
    if num_samples * max_new_tokens > MAX_NEW_TOKENS:
        raise ValueError(f"num_samples x max_new_tokens = {num_samples * max_new_tokens:,} new tokens: at most "
                         f"{MAX_NEW_TOKENS:,} ({TOKENS_WHY})")


def check_n_passes(config, n_passes):
    """ValueError when a model of this config cannot run n_passes passes (None: as trained)."""
    if n_passes is None:
        return
    if n_passes > MAX_PASSES:  # (forward would refuse it too, less plainly)
        raise ValueError(f"n_passes={n_passes}: at most {MAX_PASSES} ({PASSES_WHY})")
    if config.layout not in LOOPED_LAYOUTS:
        raise ValueError(f"n_passes={n_passes}: the model has layout {config.layout!r}, nothing to loop "
                         f"(n_passes applies to layouts {', '.join(LOOPED_LAYOUTS)})")
    execution_plan(config, n_passes)  # an untied model runs at most its cores (model.most_passes)


def check_tokenizer(config, tokenizer):
    """The tokenizer must produce ids the model knows and share its <|endoftext|> id."""
    if tokenizer.n_vocab > config.vocab_size:
        raise ValueError(f"tokenizer {tokenizer.name} has {tokenizer.n_vocab} tokens, more than the model's "
                         f"vocab_size={config.vocab_size}")
    if tokenizer.eot_token != config.eot_token:
        raise ValueError(f"tokenizer {tokenizer.name} has <|endoftext|> = {tokenizer.eot_token}, the model's "
                         f"eot_token is {config.eot_token}")


@torch.no_grad()
def generate_windowed(model, idx, max_new_tokens, temperature=1.0, top_k=None, n_passes=None, generator=None):
    """model.generate for any length: idx (B, T) -> the max_new_tokens new ids (B, max_new_tokens).
    Whenever the context reaches block_size (the prompt included), its last block_size // 2 tokens
    become the context and sampling continues from there."""
    block_size = model.config.block_size
    keep = block_size // 2
    if keep < 1:
        raise ValueError(f"block_size={block_size} leaves no room for a context and a new token")
    context, new_tokens = idx, []
    remaining = max_new_tokens
    while remaining > 0:
        if context.size(1) >= block_size:
            context = context[:, -keep:]
        n = min(remaining, block_size - context.size(1))
        context = model.generate(context, n, temperature=temperature, top_k=top_k, n_passes=n_passes,
                                 generator=generator)
        new_tokens.append(context[:, -n:])
        remaining -= n
    return torch.cat(new_tokens, dim=1) if new_tokens else idx[:, :0]


def sample_texts(model, tokenizer, start="", num_samples=1, max_new_tokens=200, temperature=0.8, top_k=200,
                 seed=1337, n_passes=None):
    """num_samples decoded samples (prompt text + continuation) from an in-memory model. Each prompt is
    <|endoftext|> + start; that leading eot is not part of the returned text."""
    check_settings(num_samples, max_new_tokens, temperature, top_k, n_passes)
    check_n_passes(model.config, n_passes)
    check_tokenizer(model.config, tokenizer)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    prompt = torch.tensor([[model.config.eot_token] + tokenizer.encode(start)], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        samples = []
        for _ in range(num_samples):
            new = generate_windowed(model, prompt, max_new_tokens, temperature, top_k, n_passes, generator)
            ids = prompt[0, 1:].tolist() + new[0].tolist()
            # a vocabulary padded beyond the tokenizer's has ids without text: they are left out
            samples.append(tokenizer.decode([i for i in ids if i < tokenizer.n_vocab]))
        return samples
    finally:
        model.train(was_training)


def sample_text(model, tokenizer, start="", max_new_tokens=200, temperature=0.8, top_k=200, seed=1337,
                n_passes=None):
    """One decoded sample (prompt text + continuation) from an in-memory model; see sample_texts."""
    return sample_texts(model, tokenizer, start, 1, max_new_tokens, temperature, top_k, seed, n_passes)[0]


def main(argv=None):
    parser = common.parser("sample.py",
                           description="Sample text from a loopstudy checkpoint (see the module docstring).")
    parser.add_argument("--ckpt", default="out/tiny/ckpt.pt",
                        help="checkpoint written by train.py (default: %(default)s)")
    parser.add_argument("--start", default="", help="prompt text, or FILE:path to read it from a file "
                        "(default: '', <|endoftext|> alone, so a fresh document)")
    parser.add_argument("--num_samples", type=number(int, 1, MAX_SAMPLES, why=SAMPLES_WHY), default=3,
                        help=f"samples to print, each followed by a line of dashes; at most {MAX_SAMPLES:,} "
                             "(default: %(default)s)")
    parser.add_argument("--max_new_tokens", type=number(int, 0, MAX_NEW_TOKENS, why=TOKENS_WHY), default=200,
                        help="new tokens per sample; any length, past block_size in windows; at most "
                             f"{MAX_NEW_TOKENS:,} over all samples (default: %(default)s)")
    parser.add_argument("--temperature", type=number(float, 0), default=0.8,
                        help="softmax temperature; 0 is greedy decoding (default: %(default)s)")
    parser.add_argument("--top_k", type=number(int, 1), default=200,
                        help="sample among the top_k most likely tokens (default: %(default)s)")
    parser.add_argument("--seed", type=number(int, 0, 2 ** 63 - 1), default=1337,
                        help="random seed: the same seed gives the same text "
                                                               "(default: %(default)s)")
    parser.add_argument("--n_passes", type=number(int, 1, MAX_PASSES, why=PASSES_WHY), default=None,
                        help="looped models: test-time passes (K for pcc, r for smelt / layer_loop), at most "
                             f"{MAX_PASSES} (default: as trained)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer name, e.g. gpt2-4096 (default: the checkpoint's)")
    parser.add_argument("--device", default="auto", help="'auto' (cuda if available, else cpu), 'cpu', 'cuda', "
                                                         "'cuda:1', ... (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        # settings first: a bad value is reported before the checkpoint is loaded
        check_settings(args.num_samples, args.max_new_tokens, args.temperature, args.top_k, args.n_passes)
        device = resolve_device(args.device)
        start = read_start(args.start)
        model, ckpt = load_model(args.ckpt)
        check_n_passes(model.config, args.n_passes)
        tokenizer_name = args.tokenizer or ckpt.get("tokenizer")
        if not tokenizer_name:
            raise ValueError(f"{args.ckpt} does not name its tokenizer: pass --tokenizer (e.g. gpt2-4096)")
        tokenizer = get_tokenizer(tokenizer_name)
        check_tokenizer(model.config, tokenizer)
    except (OSError, ValueError) as e:
        return cli_error("sample.py", e)
    model.to(device)
    for text in sample_texts(model, tokenizer, start, args.num_samples, args.max_new_tokens, args.temperature,
                             args.top_k, args.seed, args.n_passes):
        print(text)
        print(SEPARATOR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
