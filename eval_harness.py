"""
EleutherAI's lm-evaluation-harness on a checkpoint, at any number of test-time passes.

    pip install -r requirements-eval.txt   # lm-eval, an optional extra
    python eval_harness.py --ckpt CKPT --tasks hellaswag,arc_easy --limit 200
    python eval_harness.py --ckpt CKPT --tasks arc_easy --n_passes 1,2,4,8  # a column per K
    python eval_harness.py --ckpt CKPT --tasks shakespeare_cloze,shakespeare_val \
        --include_path tests/data/harness_tasks    # offline; from the repo root

After lm_class(), simple_evaluate builds it from
model="loopstudy", model_args="ckpt=CKPT,n_passes=2".
Decoding is greedy, even for a task that samples.
"""
import argparse
import functools
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

from eval_core import forward_logits, load_model_and_tokenizer, model_device
from model import KVCache
from sample import check_n_passes


@torch.no_grad()
def score_pairs(model, pairs, n_passes=None, autocast_dtype=None):
    # [(log p(continuation | context), greedy is right)] of id
    # pairs, each cut to its last block_size + 1 tokens.
    cfg, device = model.config, model_device(model)
    rows = [(c + k)[-(cfg.block_size + 1):][:-1] for c, k in pairs]
    width = max(map(len, rows))
    # FlexAttention compiles per shape: few shapes on CUDA.
    if device.type == "cuda":
        width = min(-(-width // 128) * 128, cfg.block_size)
    # One forward, right-padded with eot.
    idx = torch.full((len(rows), width), cfg.eot_token, dtype=torch.long)
    for r, row in enumerate(rows):
        idx[r, :len(row)] = torch.tensor(row)
    idx = idx.to(device)
    logits = forward_logits(model, idx, n_passes, autocast_dtype=autocast_dtype)
    out = []
    for r, (row, (_, continuation)) in enumerate(zip(rows, pairs)):
        # The row's last len(continuation) inputs predict it.
        span = logits[r, len(row) - len(continuation):len(row)]
        logprobs = F.log_softmax(span, dim=-1)
        target = torch.tensor(continuation, device=device)
        greedy = bool((logprobs.argmax(-1) == target).all())
        out.append((float(logprobs.gather(-1, target[:, None]).sum()), greedy))
    return out


@torch.no_grad()
def greedy_until(model, tokenizer, prompts, until, max_new_tokens, n_passes=None,
                 autocast_dtype=None):
    # Greedy continuations of same-length prompts with the KV cache,
    # stopped at an `until` string or max_new_tokens.
    block = model.config.block_size
    context = torch.tensor(prompts, device=model_device(model))
    new, done = [[] for _ in prompts], [max_new_tokens == 0] * len(prompts)

    def text(ids):
        return tokenizer.decode([i for i in ids if i < tokenizer.n_vocab])

    cache = None
    while not all(done):
        if cache is None or context.size(1) >= block:
            # (Re)fill the cache; as in sample.py, a full context
            # keeps its last block_size // 2 tokens.
            if context.size(1) >= block:
                context = context[:, -(block // 2):]
            cache = KVCache()
            logits = forward_logits(model, context, n_passes, cache, autocast_dtype)
        else:
            logits = forward_logits(model, token, n_passes, cache, autocast_dtype)
        token = logits[:, -1].argmax(dim=-1, keepdim=True)
        context = torch.cat([context, token], dim=1)
        for r, t in enumerate(token[:, 0].tolist()):
            if not done[r]:
                new[r].append(t)
                stop = any(s and s in text(new[r]) for s in until)
                done[r] = stop or len(new[r]) >= max_new_tokens
    return [text(ids) for ids in new]


class HarnessLM:
    # Answers lm-eval's requests with a model in memory, or with the
    # checkpoint that model_args names.

    def __init__(self, model=None, tokenizer=None, ckpt=None, n_passes=None,
                 batch_size=16, device=None, max_gen_toks=256, **kwargs):
        super().__init__()
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if model is None:
            model, tokenizer = load_model_and_tokenizer(ckpt)[:2]
        self.model = model.to(self._device).eval()
        self.tokenizer, self.source = tokenizer, ckpt
        self.n_passes, self.batch_size = n_passes or None, batch_size
        self.max_gen_toks = max_gen_toks
        self.autocast_dtype = torch.bfloat16 if self._device.type == "cuda" else None

    eot_token_id = property(lambda self: self.tokenizer.eot_token)
    max_length = property(lambda self: self.model.config.block_size)

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        # Every context follows <|endoftext|>, as in training.
        bos = [] if add_special_tokens is False else [self.eot_token_id]
        return bos + self.tokenizer.encode(string)

    def _loglikelihood_tokens(self, requests, disable_tqdm=False):
        # [(log-likelihood, greedy)] of (key, context, continuation)
        # requests, batched longest first by lm-eval's Collator.
        from lm_eval.models.utils import Collator

        collator = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        results = []
        for chunk in collator.get_batched(n=self.batch_size):
            pairs = [r[1:] for r in chunk]
            results += score_pairs(self.model, pairs, self.n_passes, self.autocast_dtype)
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        # Each document's log-likelihood over lm-eval's disjoint
        # windows.
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for i, request in enumerate(requests):
            ids = self.tok_encode(request.args[0], add_special_tokens=False)
            for window in get_rolling_token_windows(ids, self.prefix_token_id, self.max_length, 1):
                windows.append((None, *make_disjoint_window(window)))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm=False):
        from lm_eval.models import utils

        jobs, out = [], [None] * len(requests)
        for i, (context, gen_kwargs) in enumerate(r.args for r in requests):
            kwargs = utils.normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = tuple(utils.handle_stop_sequences(kwargs.pop("until", None), "<|endoftext|>"))
            n = kwargs["max_gen_toks"]
            # A long prompt keeps its last tokens, leaving room for new
            # ones.
            ids = self.tok_encode(context)[-(self.max_length - min(n, self.max_length // 2)):]
            jobs.append((len(ids), until, n, i, ids))
        # Longest first, as lm-eval orders them; a batch shares
        # length, stop strings and budget.
        jobs.sort(key=lambda j: (-j[0], j[1:4]))
        for (_, until, n), group in itertools.groupby(jobs, lambda j: j[:3]):
            group = list(group)
            for start in range(0, len(group), self.batch_size):
                batch = group[start:start + self.batch_size]
                texts = greedy_until(self.model, self.tokenizer, [j[4] for j in batch], until, n,
                                     self.n_passes, self.autocast_dtype)
                for job, text in zip(batch, texts):
                    out[job[3]] = utils.postprocess_generated_text(text, list(until), None)
        return out

    def get_model_info(self):
        # What lm-eval records of the model in its results' config.
        cfg = self.model.config
        return {"model_source": self.source, "layout": cfg.layout,
                "n_passes": self.n_passes or cfg.n_passes}


@functools.cache
def lm_class():
    # HarnessLM as an lm-eval TemplateLM, registered as "loopstudy".
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model

    cls = type("LoopstudyLM", (HarnessLM, TemplateLM), {"__module__": __name__})
    try:
        register_model("loopstudy")(cls)
    except ValueError:
        # Taken: this file was imported as __main__ and eval_harness.
        pass
    return cls


def task_manager(tasks, include_path=None):
    # lm-eval's TaskManager; a ValueError names a task it lacks.
    from lm_eval.tasks import TaskManager

    # lm-eval's own index of thousands of tasks takes seconds, so
    # --include_path alone is tried first.
    for defaults in ([False] if include_path else []) + [True]:
        manager = TaskManager(include_path=include_path, include_defaults=defaults)
        unknown = [t for t in tasks if t not in manager.all_tasks and not os.path.isfile(t)]
        if not unknown:
            return manager
    hint = "(`python -m lm_eval ls tasks` lists lm-eval's)"
    raise ValueError(f"--tasks: unknown task {unknown[0]!r} {hint}")


def evaluate(lm, tasks, passes=(None,), include_path=None, manager=None, **options):
    # {K: lm-eval's results} per number of passes (None: as
    # trained), with the same simple_evaluate options.
    import lm_eval

    manager, results = manager or task_manager(tasks, include_path), {}
    for k in passes:
        lm.n_passes = k
        results[k] = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager,
                                             batch_size=lm.batch_size, **options)
    return results


def cell(metrics, key):
    # A value with its stderr, as lm-eval's table prints them.
    value, stderr = metrics[key], metrics.get(key.replace(",", "_stderr,", 1))
    if not isinstance(value, (int, float)):
        return str(value)
    if isinstance(stderr, (int, float)):
        return f"{value:.4f} ± {stderr:.4f}"
    return f"{value:.4f}"


def sweep_table(by_passes):
    # A markdown table of every task's metrics, a column per K.
    passes, first = list(by_passes), next(iter(by_passes.values()))
    better = first.get("higher_is_better", {})
    heads = " | ".join(f"n_passes={k}" for k in passes)
    lines = [f"| Tasks | Metric | {heads} |", "|---|---|" + "---:|" * len(passes)]
    for task, metrics in first["results"].items():
        for key in sorted(k for k in metrics if "," in k and "_stderr" not in k):
            name, _, filtered = key.partition(",")
            label = name if filtered == "none" else f"{name} ({filtered})"
            label += {True: " ↑", False: " ↓"}.get(better.get(task, {}).get(name), "")
            cells = " | ".join(cell(by_passes[k]["results"][task], key) for k in passes)
            lines.append(f"| {metrics.get('alias', task)} | {label} | {cells} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="eval_harness.py", usage=argparse.SUPPRESS,
                                description=__doc__.split("\n\n")[0].strip())
    arg = p.add_argument
    arg("--ckpt", required=True, help="a ckpt.pt or an export folder")
    arg("--tasks", required=True, type=lambda s: s.split(","), help="lm-eval task names or YAMLs")
    arg("--n_passes", type=lambda s: [int(k) for k in s.split(",")], default=[None],
        help="test-time passes; a comma list sweeps them (default: as trained)")
    arg("--limit", type=float, help="items per task, or a fraction below 1")
    arg("--num_fewshot", type=int, help="default: each task's own")
    arg("--include_path", help="a folder of local task YAMLs")
    arg("--batch_size", type=int, default=16, help="sequences per forward")
    arg("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="bf16 on CUDA")
    arg("--seed", type=int, help="lm-eval's four seeds (default: lm-eval's)")
    arg("--bootstrap_iters", type=int, default=100000, help="0 skips the stderrs")
    arg("--output", help="write lm-eval's results JSON here")
    arg("--log_samples", action="store_true", help="every item's requests and answers in the JSON")
    args = p.parse_args(argv)
    try:
        import lm_eval.utils
    except ImportError:
        p.error("lm-eval is not installed: pip install -r requirements-eval.txt")
    try:
        model, tokenizer, _ = load_model_and_tokenizer(args.ckpt, args.device)
        for k in args.n_passes:
            check_n_passes(model.config, k)
        manager = task_manager(args.tasks, args.include_path)
    except (OSError, ValueError, RuntimeError) as e:
        # A missing or bad file, or a bad --device, K or task.
        p.error(str(e).splitlines()[0])
    lm = lm_class()(model, tokenizer, ckpt=args.ckpt, batch_size=args.batch_size,
                    device=args.device)
    names = ("random", "numpy_random", "torch_random", "fewshot_random")
    seeds = {} if args.seed is None else {f"{s}_seed": args.seed for s in names}
    by_passes = evaluate(lm, args.tasks, args.n_passes, None, manager, limit=args.limit,
                         num_fewshot=args.num_fewshot, bootstrap_iters=args.bootstrap_iters,
                         log_samples=args.log_samples, **seeds)
    results = next(iter(by_passes.values()))
    single = len(by_passes) == 1
    print(lm_eval.utils.make_table(results) if single else sweep_table(by_passes))
    if single and results.get("groups"):
        print(lm_eval.utils.make_table(results, "groups"))
    if args.output:
        # lm-eval's results, samples only if asked; a sweep by K.
        drop = set() if args.log_samples else {"samples"}
        runs = {str(k): {key: v for key, v in r.items() if key not in drop}
                for k, r in by_passes.items()}
        data = runs.popitem()[1] if single else {"n_passes": args.n_passes, "results": runs}
        with open(args.output, "w") as f:
            json.dump(data, f, indent=2, default=lm_eval.utils.handle_non_serializable,
                      ensure_ascii=False)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
