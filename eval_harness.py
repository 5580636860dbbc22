"""
EleutherAI's lm-evaluation-harness on any loopstudy checkpoint, at any number of test-time passes.

    pip install -r requirements-eval.txt      # lm-eval and safetensors (optional extras)
    python eval_harness.py --ckpt out/tiny/ckpt.pt --tasks hellaswag,arc_easy --limit 200
    python eval_harness.py --ckpt out/randomk/ckpt.pt --tasks arc_easy --n_passes 1,2,4,8   # one table, a column per K
    python eval_harness.py --ckpt out/tiny/export --tasks my_task --include_path my_tasks/ --output results.json

The model is an lm-eval LM (its TemplateLM, lm-eval's base for models with their own tokenizer), run
through lm_eval.simple_evaluate; the table printed and the JSON written are lm-eval's:
- loglikelihood: context and continuation tokenized as lm-eval's own models split them (TemplateLM), every
  context after <|endoftext|> (every training document starts with it, as eval_core.py's prompts do). A
  pair longer than block_size keeps its rightmost block_size + 1 tokens (lm-eval's HF model's rule).
  Requests are sorted longest first (lm-eval's Collator), right-padded with eot, --batch_size per forward.
- loglikelihood_rolling: lm-eval's disjoint windows of block_size tokens (get_rolling_token_windows,
  make_disjoint_window), the first after <|endoftext|>: every token predicted once.
- generate_until: greedy, with the model's KV cache. The prompt keeps its last block_size - min(max_gen_toks,
  block_size // 2) tokens; past block_size generation goes on in sample.py's windows (the context cut to
  its last block_size // 2 tokens). A row stops at its first `until` string (or <|endoftext|>) or after
  max_gen_toks; prompts of one length and one stopping rule are batched.
- bf16 autocast on CUDA (--dtype float32: none), fp32 on a CPU; on CUDA a batch's width is rounded up to
  a multiple of 128, so FlexAttention (compiled per shape) sees few shapes.
- --n_passes K runs a looped model with K passes at test time (model.GPT's n_passes; an untied model at
  most its cores); --n_passes 1,2,4,8 runs simple_evaluate once per K and prints one table with a column
  per K (the JSON holds every run's results).

From Python: evaluate(lm_class()(model, tokenizer), ["arc_easy"], passes=[1, 2]) -> {K: lm-eval's results};
simple_evaluate(model="loopstudy", model_args="ckpt=out/tiny/ckpt.pt") works once lm_class() has run.
"""

import functools
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from data.tokenizer import get_tokenizer
from model import MAX_PASSES, PASSES_WHY, KVCache
from sample import check_n_passes, check_tokenizer
from tooling import common, distributed
from tooling.common import cli_error, number, resolve_device, write_atomic

PROG = "eval_harness.py"
INSTALL = "lm-eval is not installed: pip install -r requirements-eval.txt"
MAX_BATCH, BATCH_WHY = 4096, "sequences per forward; its logits are batch x block_size x vocabulary floats"
MAX_FEWSHOT, FEWSHOT_WHY = 100, "examples per prompt; a prompt longer than block_size loses its first tokens"
CUDA_WIDTH_STEP = 128  # FlexAttention's block: widths rounded up to it on CUDA


def require_lm_eval():
    """The lm_eval package, or one line saying how to install it."""
    try:
        import lm_eval
    except ImportError:
        raise ValueError(INSTALL) from None
    return lm_eval


def load_model_and_tokenizer(path, tokenizer_name=None):
    """(model, tokenizer, checkpoint dict) from anything the tools read: a ckpt.pt or an export folder."""
    from tooling.checkpoint import load_model
    model, ckpt = load_model(path)
    name = tokenizer_name or ckpt.get("tokenizer")
    if not name:
        raise ValueError(f"{path} does not name its tokenizer: pass --tokenizer (e.g. gpt2-4096)")
    tokenizer = get_tokenizer(name)
    check_tokenizer(model.config, tokenizer)
    return model.eval(), tokenizer, ckpt


# ----------------------------------------------------------------------------------------------------
# The model's side: token ids in, log-likelihoods and greedy text out


def forward_logits(model, idx, n_passes=None, cache=None, autocast_dtype=None):
    """model(idx) logits in fp32, under bf16 autocast when autocast_dtype is given (CUDA)."""
    with torch.autocast(idx.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        logits, _ = model(idx, n_passes=n_passes, cache=cache)
    return logits.float()


@torch.no_grad()
def score_pairs(model, pairs, n_passes=None, autocast_dtype=None):
    """[(log p(continuation | context), whether greedy decoding gives the continuation)] of each (context ids,
    continuation ids) pair, in one forward right-padded with eot (causal attention: padding after a row
    changes nothing before it). A pair longer than block_size + 1 tokens keeps its rightmost block_size + 1."""
    cfg = model.config
    device = next(model.parameters()).device
    rows = []
    for context, continuation in pairs:
        if not context or not continuation or len(continuation) > cfg.block_size:
            raise ValueError(f"a request needs a context and a continuation of 1 to block_size={cfg.block_size} "
                             f"tokens, got {len(context)} and {len(continuation)}")
        rows.append((context + continuation)[-(cfg.block_size + 1):][:-1])  # the input; its last n predict
    width = max(map(len, rows))
    if device.type == "cuda":
        width = min(-(-width // CUDA_WIDTH_STEP) * CUDA_WIDTH_STEP, cfg.block_size)
    idx = torch.full((len(rows), width), cfg.eot_token, dtype=torch.long)
    for r, row in enumerate(rows):
        idx[r, :len(row)] = torch.tensor(row)
    logits = forward_logits(model, idx.to(device), n_passes, autocast_dtype=autocast_dtype)
    out = []
    for r, (row, (_, continuation)) in enumerate(zip(rows, pairs)):
        logprobs = F.log_softmax(logits[r, len(row) - len(continuation):len(row)], dim=-1)
        target = torch.tensor(continuation, device=device)
        out.append((float(logprobs.gather(-1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all())))
    return out


@torch.no_grad()
def greedy_until(model, tokenizer, prompts, until, max_new_tokens, n_passes=None, autocast_dtype=None):
    """Greedy continuations (text) of prompts of one length (lists of ids), with the KV cache: a row stops at
    the first of the `until` strings in its text or after max_new_tokens. Whenever the context fills
    block_size it goes on from its last block_size // 2 tokens, as sample.generate_windowed does."""
    block, keep = model.config.block_size, model.config.block_size // 2
    context = torch.tensor(prompts, dtype=torch.long, device=next(model.parameters()).device)
    new, done = [[] for _ in prompts], [max_new_tokens == 0] * len(prompts)

    def text(ids):  # a vocabulary padded beyond the tokenizer's has ids without text: left out
        return tokenizer.decode([i for i in ids if i < tokenizer.n_vocab])

    def prefill():
        nonlocal context, cache
        context = context[:, -keep:] if context.size(1) >= block else context
        cache = KVCache()
        return forward_logits(model, context, n_passes, cache, autocast_dtype)[:, -1]

    cache = None
    last = prefill() if not all(done) else None
    while not all(done):
        token = last.argmax(dim=-1, keepdim=True)
        context = torch.cat([context, token], dim=1)
        for r, t in enumerate(token[:, 0].tolist()):
            if not done[r]:
                new[r].append(t)
                so_far = text(new[r])
                done[r] = len(new[r]) >= max_new_tokens or any(s and s in so_far for s in until)
        if not all(done):
            last = prefill() if context.size(1) >= block else \
                forward_logits(model, token, n_passes, cache, autocast_dtype)[:, -1]
    return [text(ids) for ids in new]


# ----------------------------------------------------------------------------------------------------
# The lm-eval LM


class HarnessLM:
    """lm-eval's three request types answered by a loopstudy model; lm_class() makes it an lm-eval
    TemplateLM (lm-eval imported only then). model/tokenizer: in memory; or ckpt: a path (how lm-eval's own
    simple_evaluate(model="loopstudy", model_args="ckpt=...,n_passes=2") builds it). max_batch_size: lm-eval's
    automatic batch size, unused (--batch_size is fixed)."""

    def __init__(self, model=None, tokenizer=None, ckpt=None, n_passes=None, batch_size=16, device="auto",
                 dtype="bfloat16", max_gen_toks=256, progress=True, max_batch_size=None):
        super().__init__()
        if model is None:
            model, tokenizer, _ = load_model_and_tokenizer(ckpt)
        self._device = resolve_device(device) if isinstance(device, str) else device
        self.model, self.tokenizer, self.source = model.to(self._device).eval(), tokenizer, ckpt
        self.n_passes = None if n_passes in (None, "") else int(n_passes)
        check_n_passes(model.config, self.n_passes)
        if str(batch_size).startswith("auto"):
            raise ValueError("batch_size 'auto' is not supported: give a number of sequences per forward")
        self.batch_size, self.max_gen_toks, self.progress = int(batch_size), int(max_gen_toks), progress
        self.said_greedy = False  # a task asking for sampling is told once that decoding is greedy
        self.autocast_dtype = torch.bfloat16 if self._device.type == "cuda" and dtype == "bfloat16" else None

    @property
    def eot_token_id(self):
        return self.tokenizer.eot_token

    @property
    def max_length(self):
        return self.model.config.block_size

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        """Ids of `string`, after <|endoftext|> (the BOS every training document starts with) unless
        add_special_tokens=False (lm-eval then puts its prefix_token_id, the same eot, where one is needed)."""
        ids = self.tokenizer.encode(string)
        return ids if add_special_tokens is False else [self.eot_token_id] + ids

    def tok_decode(self, tokens, **kwargs):
        return self.tokenizer.decode([t for t in tokens if t < self.tokenizer.n_vocab])

    def _loglikelihood_tokens(self, requests, disable_tqdm=False):
        """[(log-likelihood, greedy)] of (request strings or None, context ids, continuation ids), longest
        first in batches of batch_size (lm-eval's Collator), in the requests' order."""
        from lm_eval.models.utils import Collator
        collator = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        results = []
        with tqdm(total=len(requests), desc="loglikelihood", disable=disable_tqdm or not self.progress,
                  file=sys.stderr) as bar:
            for chunk in collator.get_batched(n=self.batch_size):
                scores = score_pairs(self.model, [(c, k) for _, c, k in chunk], self.n_passes, self.autocast_dtype)
                for (key, _, _), answer in zip(chunk, scores):
                    if key is not None:  # rolling windows are cached per document, below
                        self.cache_hook.add_partial("loglikelihood", key, answer)
                results += scores
                bar.update(len(chunk))
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """Each document's log-likelihood over lm-eval's disjoint windows of block_size tokens."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
        windows, owner = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            ids = self.tok_encode(text, add_special_tokens=False)
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=ids, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm=False):
        """Greedy continuations, cut at the request's `until` strings (lm-eval's stop handling)."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
        jobs = []
        for i, (context, gen_kwargs) in enumerate(r.args for r in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample") and not self.said_greedy:
                print(f"{PROG}: a task asks for sampling: decoded greedily here", file=sys.stderr)
                self.said_greedy = True
            until = tuple(handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id])))
            n = kwargs["max_gen_toks"]
            ids = self.tok_encode(context)[-(self.max_length - min(n, self.max_length // 2)):]
            jobs.append((len(ids), until, n, i, ids))
        jobs.sort(key=lambda job: (-job[0], job[1:3], job[3]))  # longest first, as lm-eval orders them
        out = [None] * len(requests)
        with tqdm(total=len(jobs), desc="generate_until", disable=disable_tqdm or not self.progress,
                  file=sys.stderr) as bar:
            for (_, until, n), group in itertools.groupby(jobs, key=lambda job: job[:3]):
                group = list(group)
                for start in range(0, len(group), self.batch_size):
                    batch = group[start:start + self.batch_size]
                    texts = greedy_until(self.model, self.tokenizer, [job[4] for job in batch], until, n,
                                         self.n_passes, self.autocast_dtype)
                    for job, text in zip(batch, texts):
                        out[job[3]] = postprocess_generated_text(text, list(until), None)
                        self.cache_hook.add_partial("generate_until", requests[job[3]].args, out[job[3]])
                    bar.update(len(batch))
        return out

    def get_model_info(self):
        """What lm-eval records of the model in its results' "config"."""
        cfg = self.model.config
        return {"model_num_parameters": self.model.num_params()["total"], "model_source": self.source,
                "layout": cfg.layout, "n_passes": self.n_passes or cfg.n_passes, "trained_n_passes": cfg.n_passes,
                "model_dtype": "bfloat16 autocast" if self.autocast_dtype else "float32"}


@functools.cache
def lm_class():
    """HarnessLM as an lm-eval TemplateLM, registered with lm-eval as model "loopstudy"."""
    require_lm_eval()
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    cls = type("LoopstudyLM", (HarnessLM, TemplateLM), {"__module__": __name__, "__doc__": HarnessLM.__doc__})
    try:
        register_model("loopstudy")(cls)
    except ValueError:  # the name is taken: this file imported twice (as __main__ and as eval_harness)
        pass
    return cls


# ----------------------------------------------------------------------------------------------------
# Running lm-eval


def task_manager(tasks, include_path=None):
    """lm-eval's TaskManager that knows `tasks` (names, or paths of task YAMLs): --include_path's folder
    alone when it holds them all (indexing lm-eval's own thousands of tasks takes seconds), else both."""
    from lm_eval.tasks import TaskManager
    if include_path and not os.path.isdir(include_path):
        raise ValueError(f"--include_path {include_path}: no such folder (a folder of task YAML files)")
    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if not unknown_tasks(local, tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = unknown_tasks(manager, tasks)
    if unknown:
        raise ValueError(f"--tasks: unknown task {unknown[0]!r} (`python -m lm_eval ls tasks` lists lm-eval's "
                         f"{len(manager.all_tasks):,}; local task YAMLs: --include_path DIR)")
    return manager


def unknown_tasks(manager, tasks):
    return [t for t in tasks if t not in manager.all_tasks and not os.path.isfile(t)]


def evaluate(lm, tasks, passes=(None,), include_path=None, manager=None, **options):
    """lm_eval.simple_evaluate once per number of passes (None: as trained) -> {K: lm-eval's results dict}.
    manager: a task_manager() (default: one for tasks and include_path). options: simple_evaluate's
    (num_fewshot, limit, bootstrap_iters, the seeds, log_samples, ...); every run seeds alike, so a sweep
    gives what separate runs give."""
    lm_eval = require_lm_eval()
    manager = manager or task_manager(list(tasks), include_path)
    for k in passes:
        check_passes(lm.model.config, k)
    results, given = {}, lm.n_passes
    try:
        for k in passes:
            lm.n_passes, start = k, time.time()
            results[k] = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager,
                                                 batch_size=lm.batch_size, device=str(lm.device), **options)
            print(f"{PROG}: n_passes={k or lm.model.config.n_passes}: {time.time() - start:.1f} s", file=sys.stderr)
    finally:
        lm.n_passes = given
    return results


def check_passes(config, k):
    """The one line refusing --n_passes K for this model (plain layout, beyond an untied model's cores)."""
    try:
        check_n_passes(config, k)
    except ValueError as e:
        raise ValueError(f"--n_passes {k}: {str(e).removeprefix(f'n_passes={k}: ')}") from None


def cell(metrics, key):
    """A value of lm-eval's results with its stderr, as its table prints them."""
    value, stderr = metrics.get(key), metrics.get(key.replace(",", "_stderr,", 1))
    if not isinstance(value, (int, float)):
        return "" if value is None else str(value)
    return f"{value:.4f}" + (f" ± {stderr:.4f}" if isinstance(stderr, (int, float)) else "")


def sweep_table(by_passes):
    """One markdown table of every task's metrics, a column per number of passes (the sweep's table)."""
    passes = list(by_passes)
    first = by_passes[passes[0]]
    lines = ["| Tasks | Metric | " + " | ".join(f"n_passes={k}" for k in passes) + " |",
             "|---|---|" + "---:|" * len(passes)]
    for task, metrics in first["results"].items():
        shown = metrics.get("alias", task)
        for key in sorted(metrics):
            name, _, filter_name = key.partition(",")
            if not filter_name or name.endswith("_stderr"):
                continue
            better = {True: " ↑", False: " ↓"}.get(first.get("higher_is_better", {}).get(task, {}).get(name), "")
            label = (name if filter_name == "none" else f"{name} ({filter_name})") + better
            values = [cell(by_passes[k]["results"].get(task, {}), key) for k in passes]
            lines.append(f"| {shown} | {label} | " + " | ".join(values) + " |")
            shown = ""
    return "\n".join(lines)


def write_results(path, by_passes, keep_samples):
    """lm-eval's results as JSON, atomically: one run's dict as lm-eval writes it; a sweep's runs keyed by K."""
    from lm_eval.utils import handle_non_serializable
    runs = {k: {key: v for key, v in r.items() if keep_samples or key != "samples"} for k, r in by_passes.items()}
    data = runs[next(iter(runs))] if len(runs) == 1 else {"n_passes": list(runs),
                                                        "results": {str(k): r for k, r in runs.items()}}
    text = json.dumps(data, indent=2, default=handle_non_serializable, ensure_ascii=False)
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))


# ----------------------------------------------------------------------------------------------------
# Command line


def passes_list(text):
    """--n_passes: one number of passes, or several separated by commas (a sweep)."""
    import argparse
    one = number(int, 1, MAX_PASSES, why=PASSES_WHY)
    values = [one(part.strip()) for part in text.split(",")]
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text}: each number of passes once")
    return values


def limit_value(text):
    """--limit: items per task, or a fraction of them below 1 (lm-eval's meaning)."""
    import argparse
    value = number(float, 0, open_low=True)(text)
    if value >= 1 and value != int(value):
        raise argparse.ArgumentTypeError(f"{text}: a number of items (an integer) or a fraction below 1")
    return int(value) if value >= 1 else value


def build_parser():
    p = common.parser(PROG, description="lm-evaluation-harness on a loopstudy checkpoint (see the module docstring).")
    p.add_argument("--ckpt", required=True, help="a ckpt.pt train.py or grow.py wrote, or an export folder (required)")
    p.add_argument("--tasks", required=True, help="comma list of lm-eval task names or task YAML paths (required)")
    p.add_argument("--n_passes", type=passes_list, default=None, metavar="K[,K...]",
                   help="test-time passes of a looped model; a comma list sweeps them, one table with a column per "
                        f"K; each at most {MAX_PASSES} (default: as trained)")
    p.add_argument("--limit", type=limit_value, default=None, metavar="N",
                   help="items per task, or a fraction below 1 (default: all)")
    p.add_argument("--num_fewshot", type=number(int, 0, MAX_FEWSHOT, why=FEWSHOT_WHY), default=None,
                   help="few-shot examples per prompt (default: each task's own)")
    p.add_argument("--include_path", default=None, metavar="DIR", help="a folder of local task YAMLs (default: none)")
    p.add_argument("--batch_size", type=number(int, 1, MAX_BATCH, why=BATCH_WHY), default=16,
                   help="sequences per forward (default: %(default)s)")
    p.add_argument("--device", default="auto", help="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', "
                                                    "... (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="autocast on CUDA; a CPU always runs float32 (default: %(default)s)")
    p.add_argument("--tokenizer", default=None, help="tokenizer name, e.g. gpt2-4096 (default: the checkpoint's)")
    p.add_argument("--seed", type=number(int, 0, 2 ** 32 - 1), default=None,
                   help="one seed for Python, numpy, torch and the few-shot draws, as lm-eval's --seed N "
                        "(default: lm-eval's, 0,1234,1234,1234)")
    p.add_argument("--bootstrap_iters", type=number(int, 0, 10 ** 6), default=100000,
                   help="lm-eval's bootstrap for the stderr of some metrics; 0 skips stderrs (default: %(default)s)")
    p.add_argument("--output", default=None, metavar="PATH", help="write lm-eval's results JSON here (default: none)")
    p.add_argument("--log_samples", action="store_true", help="keep every item's requests and answers in the JSON "
                                                              "(default: results only)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        require_lm_eval()
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        if not tasks:
            raise ValueError("--tasks: give at least one task")
        if args.output and os.path.isdir(args.output):
            raise ValueError(f"--output {args.output} is a folder: give the path of the JSON file to write")
        device = resolve_device(args.device)
        model, tokenizer, _ = load_model_and_tokenizer(args.ckpt, args.tokenizer)
        passes = args.n_passes or [None]
        for k in passes:
            check_passes(model.config, k)
        manager = task_manager(tasks, args.include_path)  # an unknown task: one line before any work
        lm = lm_class()(model, tokenizer, ckpt=args.ckpt, batch_size=args.batch_size, device=device, dtype=args.dtype)
        cfg = model.config
        print(f"{PROG}: {args.ckpt}: {cfg.layout}, {cfg.n_layer} layers, trained with n_passes={cfg.n_passes}; "
              f"tokenizer {tokenizer.name}; device {device}{' (bf16 autocast)' if lm.autocast_dtype else ''}",
              file=sys.stderr)
        if device.type == "cpu":  # threads beyond the idle cores spin against the other load (train.py's rule)
            print(f"{PROG}: {distributed.cpu_threads()}", file=sys.stderr)
        seeds = {} if args.seed is None else {f"{s}_seed": args.seed for s in ("random", "numpy_random",
                                                                               "torch_random", "fewshot_random")}
        by_passes = evaluate(lm, tasks, passes, manager=manager, num_fewshot=args.num_fewshot, limit=args.limit,
                             bootstrap_iters=args.bootstrap_iters, log_samples=args.log_samples, **seeds)
        if args.output:
            write_results(args.output, by_passes, args.log_samples)
    except (OSError, ValueError) as e:
        return cli_error(PROG, e)
    if len(by_passes) == 1:
        from lm_eval.utils import make_table
        results = next(iter(by_passes.values()))
        print(make_table(results))
        if results.get("groups"):
            print(make_table(results, "groups"))
    else:
        print(sweep_table(by_passes))
    if args.output:
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
