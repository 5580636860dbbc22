"""
data/prepare.py at two corpus sizes: tokens/s with 1 and 2 workers against raw tiktoken on the same text,
peak RSS of the prepare process tree, disk per token, and train.py's start-up on each prepared corpus.

    python bench/prepare.py                              # about 4M and 40M GPT-2 tokens, 1 and 2 workers
    python bench/prepare.py --sizes 4e6 --workers 1 2 4

The corpus is generated: documents of 20-120 random lines of the embedded Shakespeare corpus, in jsonl
files of about 2M tokens each (as real dumps come in many files), two sources. Every prepare runs as
`python data/prepare.py ... --tokenizer gpt2` in its own process; its tokens/s is tokens / the seconds it
reports (pool start-up, fingerprint and the counting pass included, interpreter start-up not). Peak RSS:
ru_maxrss of the largest process (RUSAGE_CHILDREN of a wrapper per prepare) and the sum over the process
tree, sampled every 20 ms from /proc. Raw tiktoken: encode_ordinary_batch(texts, num_threads=1) with the
tokenizer object data.tokenizer.get_tokenizer("gpt2") gives prepare, timed on the same documents in this
run (one thread: the baseline one worker is held to). Targets (not asserted): RSS <= 1 GB and growing
<= 10% from the small to the large corpus; W workers >= 0.8 * W * raw; train.py's start-up within 10%
between the two corpora. One JSON line per measurement.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from data import documents, loader, prepare as prep, shards  # noqa: E402
from data.tokenizer import get_tokenizer  # noqa: E402
from tooling.common import number, parser as common_parser  # noqa: E402

FILE_TOKENS = 2_000_000


def generate_corpus(folder, n_tokens, seed=0):
    """jsonl files of generated documents totalling about n_tokens GPT-2 tokens; returns their paths."""
    with open(prep.DEFAULT_CORPUS) as f:
        lines = [line for row in f for line in json.loads(row)["text"].splitlines(keepends=True) if line.strip()]
    rng = np.random.default_rng(seed)
    tok = get_tokenizer("gpt2")
    sample = "".join(lines[i] for i in rng.integers(0, len(lines), 20_000))
    bytes_per_token = len(sample.encode()) / len(tok.encode(sample))
    os.makedirs(folder, exist_ok=True)
    paths, written, doc = [], 0, 0
    while written < n_tokens:
        path = os.path.join(folder, f"part_{len(paths):04d}.jsonl")
        with open(path, "w") as f:
            budget = min(FILE_TOKENS, n_tokens - written) * bytes_per_token
            size = 0
            while size < budget:
                text = "".join(lines[i] for i in rng.integers(0, len(lines), int(rng.integers(20, 120))))
                f.write(json.dumps({"text": text, "source": "odd" if doc % 2 else "even"}) + "\n")
                size += len(text.encode())
                doc += 1
        written += int(size / bytes_per_token)
        paths.append(path)
    return paths


def tree_rss_kb(pid):
    """Resident memory of pid and all its descendants (kB), from /proc."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            with open(f"/proc/{p}/task/{p}/children") as f:
                stack.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            pass
    return total


def run_measured(cmd):
    """Run cmd in a wrapper process reporting its children's ru_maxrss; sample the tree's RSS meanwhile.
    Returns (stdout, wall seconds, largest process MB, tree peak MB)."""
    wrapper = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
               "sys.stderr.write(r.stderr); print(r.stdout + '\\nMAXRSS_KB', "
               "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", wrapper, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss_kb(proc.pid))
            time.sleep(0.02)
    sampler = threading.Thread(target=sample)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    maxrss = int(re.search(r"MAXRSS_KB (\d+)", out).group(1))
    return out, wall, maxrss / 1024, peak[0] / 1024


def raw_tiktoken(paths, limit_tokens):
    """tokens/s of encode_ordinary_batch(num_threads=1) on the documents of paths (up to limit_tokens)."""
    texts = [row["text"] for path in paths for _, row in documents.read_jsonl(path)]
    enc = get_tokenizer("gpt2").encoding
    t0 = time.perf_counter()
    n, i = 0, 0
    while n < limit_tokens and i < len(texts):
        n += sum(map(len, enc.encode_ordinary_batch(texts[i:i + 256], num_threads=1)))
        i += 256
    return n / (time.perf_counter() - t0), n


def train_start(data_dirs, out_dir, repeats=3):
    """{data_dir: (fastest wall seconds of a 1-step train.py run on it, fastest loader.load_data seconds)}.
    A small dense model: start-up, data opening, two evals, one step, a checkpoint, all but the opening
    independent of the corpus. The runs alternate between the folders, so a change in the machine's load
    touches each alike."""
    walls, opens = {d: [] for d in data_dirs}, {d: [] for d in data_dirs}
    for i in range(repeats):
        for k, data_dir in enumerate(data_dirs):
            t0 = time.perf_counter()
            loader.load_data(data_dir)
            opens[data_dir].append(time.perf_counter() - t0)
            cmd = [sys.executable, "train.py", f"--data_dir={data_dir}", f"--out_dir={out_dir}", f"--run_name=r{k}_{i}",
                   "--max_steps=1", "--warmup_steps=1", "--eval_interval=1", "--eval_tokens=256", "--batch_size=2", "--block_size=128",
                   "--n_layer=2", "--n_embd=64", "--n_head=2", "--n_expert=0", "--vocab_size=50257"]
            t0 = time.perf_counter()
            subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
            walls[data_dir].append(time.perf_counter() - t0)
    return {d: (min(walls[d]), min(opens[d])) for d in data_dirs}


def main(argv=None):
    parser = common_parser("bench/prepare.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=number(float, 1e5), nargs="+", default=[4e6, 4e7],
                        help="corpus sizes in GPT-2 tokens")
    parser.add_argument("--workers", type=number(int, 1), nargs="+", default=[1, 2])
    parser.add_argument("--raw_tokens", type=number(float, 1e4), default=4e6, help="tokens the raw tiktoken timing encodes")
    parser.add_argument("--tmp", default=None, help="work folder (default: a new temp folder, removed at the end)")
    args = parser.parse_args(argv)
    root = args.tmp or tempfile.mkdtemp(prefix="bench_prepare_")
    machine = dict(cpus=os.cpu_count(), load_1min=round(os.getloadavg()[0], 2))
    prepared = {}  # a prepared folder of each size -> its tokens
    try:
        for size in args.sizes:
            paths = generate_corpus(os.path.join(root, f"corpus_{size:.0e}"), int(size))
            raw, raw_n = raw_tiktoken(paths, args.raw_tokens)
            print(json.dumps(dict(bench="prepare_raw_tiktoken", corpus_tokens=int(size), tokens=raw_n,
                                  tokens_per_s=round(raw), threads=1, **machine)), flush=True)
            for workers in args.workers:
                out = os.path.join(root, f"out_{size:.0e}_w{workers}")
                stdout, wall, maxrss, tree = run_measured(
                    [sys.executable, "data/prepare.py", *paths, "--tokenizer", "gpt2", "--out", out,
                     "--workers", str(workers), "--val_tokens", "100000"])
                seconds = float(re.search(r"prepared .* in ([\d.]+)s", stdout).group(1))
                meta = shards.load_meta(out)
                tokens = sum(meta["splits"][s]["tokens"] for s in prep.SPLITS)
                disk = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
                print(json.dumps(dict(
                    bench="prepare", corpus_tokens=tokens, workers=workers, seconds=round(seconds, 2),
                    wall_s=round(wall, 2), tokens_per_s=round(tokens / seconds),
                    vs_raw=round(tokens / seconds / raw, 3), target_vs_raw=0.8 * workers,
                    peak_rss_mb_largest_process=round(maxrss, 1), peak_rss_mb_tree=round(tree, 1),
                    disk_bytes_per_token=round(disk / tokens, 3), shards=len(meta["shards"]["train"]),
                    documents=sum(meta["splits"][s]["documents"] for s in prep.SPLITS),
                    load_1min=round(os.getloadavg()[0], 2))), flush=True)
            prepared[out] = tokens
        for data_dir, (wall, open_seconds) in train_start(list(prepared), os.path.join(root, "train")).items():
            print(json.dumps(dict(bench="train_start", corpus_tokens=prepared[data_dir],
                                  train_py_1_step_wall_s=round(wall, 2), load_data_s=round(open_seconds, 4),
                                  load_1min=round(os.getloadavg()[0], 2))), flush=True)
    finally:
        if not args.tmp:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
