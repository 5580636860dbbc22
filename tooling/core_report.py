"""
The command line of eval_core.py around its scoring: the argument parser (every flag with its help and
range), the --fewshot_seeds list, and the tables it prints: CORE per task with the bundle's fingerprint and
baseline version, the k-shot sweep and the per-document-length-bucket loss, each from the report dict
eval_core returns (its --json prints the same dict). Nothing here computes a score, so it is tooling (it
imports only tooling.common).

Guards against: a flag taken by an abbreviation, a count out of its range (--batch_tokens 0,
--max_per_task -2) and a seed list that is not distinct integers, each one line naming the flag.
"""
from tooling import common


TYPE_SHORT = {"multiple_choice": "MC", "schema": "schema", "language_modeling": "LM"}


def format_core_table(res):
    lines = [f"bundle      {res['bundle']}",
             f"fingerprint sha256 {res['fingerprint']} ({res['fingerprint_known'] or 'not a known public bundle'})",
             f"baselines   random-baseline version: {res['baseline_version']}",
             f"few-shot    seeds {res['fewshot_seeds']}, max_per_task {res['max_per_task']}",
             f"{'task':34s} {'type':6s} {'shots':>5s} {'n':>6s} {'accuracy':>9s} {'centered':>9s} {'answer_nll':>10s}"]
    for label, r in res["tasks"].items():
        lines.append(f"{label:34s} {TYPE_SHORT[r['task_type']]:6s} {r['num_fewshot']:5d} {r['n']:6d} "
                     f"{r['accuracy']:9.4f} {r['centered']:9.4f} {r['answer_nll']:10.4f}")
    lines.append(f"{'CORE (' + str(res['n_tasks']) + ' tasks) [X17]/[X18]':53s} {'':9s} {res['core']:9.4f} "
                 f"{res['core_nll']:10.4f}")
    if res["core17"] is None:
        lines.append(f"CORE-17 [X]: n/a (needs the 17 public task labels, {len(res['core17_missing'])} missing)")
    else:
        lines.append(f"{'CORE-17 [X Table 10]':53s} {'':9s} {res['core17']:9.4f} {res['core17_nll']:10.4f}")
    fixed = {l: r["boundary_fixed"] for l, r in res["tasks"].items() if r["boundary_fixed"]}
    if fixed:
        lines.append(f"note: LM items whose prompt-without tokens were not a prefix of prompt-with "
                     f"(span started at the common prefix; nanochat would assert): {fixed}")
    short = {l: f"{r['fewshot_used']} of {r['num_fewshot']}" for l, r in res["tasks"].items()
             if r["fewshot_used"] < r["num_fewshot"]}
    if short:
        lines.append(f"note: tasks with fewer other items than shots used all of them (nanochat's sample would "
                     f"raise): {short}")
    cropped = {l: r["answer_cropped"] for l, r in res["tasks"].items() if r["answer_cropped"]}
    if cropped:
        lines.append(f"note: items whose answer NLL lost tokens to the crop to the model context: {cropped}")
    return "\n".join(lines)


def print_kshot_table(sweep):
    print("\nk-shot sweep [S ICL]: accuracy per k")
    print(f"{'task':34s} " + " ".join(f"{'k=' + str(k):>7s}" for k in sweep["ks"]))
    for label, per_k in sweep["tasks"].items():
        print(f"{label:34s} " + " ".join(f"{per_k[k]['accuracy']:7.4f}" for k in sweep["ks"]))
    print(f"{'mean centered':34s} " + " ".join(f"{sweep['mean'][k]['centered']:7.4f}" for k in sweep["ks"]))
    short = {f"{label} k={k}": per_k[k]["fewshot_used"] for label, per_k in sweep["tasks"].items()
             for k in sweep["ks"] if per_k[k]["fewshot_used"] < k}
    if short:
        print(f"note: shots used where a task has fewer other items than k (nanochat's sample would raise): {short}")


def print_length_table(buckets, split, data_dir):
    print(f"\nper-document-length-bucket {split} loss [S] ({data_dir})")
    print(f"{'bucket':>8s} {'docs':>7s} {'tokens':>9s} {'loss':>8s}")
    for lab, b in buckets.items():
        loss = f"{b['loss']:8.4f}" if b["loss"] is not None else f"{'-':>8s}"
        print(f"{'<=' + lab if lab[0] != '>' else lab:>8s} {b['n_docs']:7d} {b['n_tokens']:9d} {loss}")


def parse_seeds(text):
    """--fewshot_seeds '0,1,2' -> [0, 1, 2]."""
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--fewshot_seeds must be distinct integers separated by commas like 0,1,2, "
                         f"got {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--fewshot_seeds must be distinct, got {text!r}")
    return seeds


def build_parser(prog, fewshot_seed, kshot_sweep, default_device):
    """eval_core.py's parser: fewshot_seed the default --fewshot_seeds (nanochat's), kshot_sweep the ks of
    --kshot_sweep, default_device the --device default (cuda when available)."""
    number = common.number
    p = common.parser(prog, description="DCLM CORE evaluation (nanochat-compatible), answer NLL, sweeps")
    p.add_argument("--ckpt", required=True, help="checkpoint written by train.py (required)")
    p.add_argument("--bundle",
                   help="eval bundle dir (core.yaml, eval_data/, eval_meta_data.csv) (default: none, no CORE)")
    p.add_argument("--max_per_task", type=number(int, -1), default=-1,
                   help="items per task after the 1337 shuffle, -1 for all (default: %(default)s)")
    p.add_argument("--fewshot_seeds", default=str(fewshot_seed),
                   help="comma list; item idx draws with random.Random(seed + idx); '0,1,2' = [X] seeds "
                        "(default: %(default)s, nanochat's)")
    p.add_argument("--tasks", default=None, help="comma list of task labels (default: all in the bundle)")
    p.add_argument("--kshot_sweep", action="store_true", help=f"[S ICL] sweep k in {kshot_sweep} (default: off)")
    p.add_argument("--kshot_tasks", default=None, help="comma list for the sweep (default: few-shot tasks)")
    p.add_argument("--length_buckets", metavar="DATA_DIR", default=None,
                   help="per-document-length-bucket val loss on a data/prepare.py output dir (default: none)")
    p.add_argument("--length_split", default="val", choices=["train", "val"],
                   help="the split of --length_buckets' data to measure (default: %(default)s)")
    p.add_argument("--length_max_tokens", type=number(int, 1), default=1 << 20,
                   help="token budget for --length_buckets, in whole documents (default: %(default)s)")
    p.add_argument("--baselines", choices=["bundle", "v1", "2025-09-05"], default="bundle",
                   help="random baselines: the bundle's csv as is, or one published version for the 3 rows that "
                        "changed (default: %(default)s)")
    p.add_argument("--device", default=default_device,
                   help="torch device to evaluate on, e.g. cpu, cuda, cuda:1 (default: cuda when available, else cpu)")
    p.add_argument("--batch_tokens", type=number(int, 1), default=16384,
                   help="padded tokens per forward (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="autocast on CUDA (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables (default: tables)")
    p.add_argument("--no_progress", action="store_true", help="no tqdm progress bars (default: bars on stderr)")
    return p
