"""
The first run on a lent CUDA machine, in stages, through train.py itself; bench/gpu_check.sh is the entry
point and holds the time budget. Each stage prints one JSON line (paste it into docs/efficiency.md) and keeps
the last 64 KiB of each command's output in $OUT/gpu_check/<stage>/; runs write into a scratch folder that
is deleted at the end, and every input is made here (the corpora prepared from data/corpus/, seconds).

    python bench/gpu_check.py all                    # env correctness distributed tiny x_d8 s95, 8 minutes at most
    python bench/gpu_check.py x_d8 s95               # some stages again
    python bench/gpu_check.py --dry-run all          # this CPU: every stage's plumbing at toy sizes

A throughput run trains WARMUP steps (compilation, the FlexAttention kernels, the Triton kernels) and then
TIMED steps, with an eval of one window at each: tokens/s and FLOPs/s are the differences of train.py's own
log (tokens, the analytic FLOPs of match.flops_per_token, seconds) between the end of the warm-up and the
last step. MFU = FLOPs/s / PEAK_FLOPS. Peak memory is the log's peak_memory_gb (torch.cuda's
max_memory_allocated) against the planner's estimate for the same run, tooling.memory.run_bytes (the figure
train.py checks before it starts), as a ratio.
"""
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import grow  # noqa: E402
import train  # noqa: E402
from tooling import common, guards, memory  # noqa: E402

PEAK_FLOPS = 989.5e12  # H200 SXM dense bf16: 1,979 TFLOPS with 2:4 sparsity, half without (NVIDIA H200 datasheet)
WARMUP, TIMED = 5, 10  # steps before the timed window, steps in it
DEADLINE_S = 480  # all requested stages together; a stage that would start later is skipped
LOG_TAIL = 64 * 1024  # bytes of each command's output kept
GIB = 2 ** 30


@dataclasses.dataclass
class Stage:
    estimate_s: int  # from first principles: bench/gpu_check.sh's header
    cap_s: int  # the most it may take: its commands are stopped at this
    extra: bool = False  # not part of `all`


STAGES = {"env": Stage(10, 30), "correctness": Stage(60, 150), "distributed": Stage(45, 120),
          "tiny": Stage(60, 150), "x_d8": Stage(105, 210), "s95": Stage(115, 225),
          "s95_compile": Stage(200, 240, extra=True)}


class Check:
    """One invocation: the scratch folder, the logs, the clock, dry run or not."""

    def __init__(self, out, dry_run, deadline_s, peak_flops):
        self.dry_run, self.peak_flops = dry_run, peak_flops
        self.logs = os.path.join(out, "gpu_check")
        self.scratch = tempfile.mkdtemp(prefix="gpu_check.")
        self.deadline_s, self.end = deadline_s, time.monotonic() + deadline_s
        self.data = {}
        self.device = "cpu" if dry_run else "cuda"

    def left(self):
        return self.end - time.monotonic()

    def command(self, stage, name, cmd, timeout, env=None):
        """Run cmd (a list) from the repo root, its output into the stage's log; {"log", "ok", "status",
        "seconds"} and the output's text. Stopped (the whole process group) after `timeout` seconds."""
        folder = os.path.join(self.logs, stage)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{name}.txt")
        print(f"gpu_check: {stage}: {name} (at most {timeout:.0f} s)", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        with open(path, "w+b") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=dict(os.environ, **(env or {})))
            try:
                status = proc.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                stop(proc)
                status = "timeout"
            log.seek(0)
            text = log.read().decode(errors="replace")
        with open(path, "w") as f:  # keep the tail only
            f.write(text[-LOG_TAIL:])
        result = dict(log=f"{stage}/{name}.txt", ok=status == 0, status=status, seconds=round(time.monotonic() - t0, 1))
        if status != 0:
            result["error"] = last_line(text) if status != "timeout" else f"stopped after {timeout:.0f} s"
        return result, text

    def prepared(self, tokenizer):
        """The embedded corpus prepared with this tokenizer into the scratch folder (once per invocation)."""
        if tokenizer not in self.data:
            out = os.path.join(self.scratch, f"data_{tokenizer}")
            subprocess.run([sys.executable, "data/prepare.py", "--tokenizer", tokenizer, "--out", out], cwd=REPO,
                           check=True, capture_output=True)
            self.data[tokenizer] = out
        return self.data[tokenizer]


def stop(proc):
    """SIGTERM to the process group (torchrun and its workers), SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def last_line(text):
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def read_log(path):
    """The JSON lines of a train.py log.jsonl ([] when there is none)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def throughput(rows, warmup, peak_flops):
    """tokens/s, MFU and step time between the log line at step `warmup` and the last one (train.py's
    cumulative tokens, analytic FLOPs and seconds); None without both lines."""
    start = next((r for r in rows if r["step"] == warmup), None)
    if start is None or rows[-1]["step"] <= warmup:
        return None
    end = rows[-1]
    seconds, steps = end["seconds"] - start["seconds"], end["step"] - start["step"]
    tokens, flops = end["tokens"] - start["tokens"], end["flops"] - start["flops"]
    first = rows[0]["seconds"] if rows[0]["step"] == 0 else 0.0
    return dict(tokens_per_s=round(tokens / seconds, 1), mfu=round(flops / seconds / peak_flops, 4),
                ms_per_step=round(1000 * seconds / steps, 2), timed_steps=steps, tokens_per_step=tokens // steps,
                flops_per_token=float(f"{flops / tokens:.4g}"), warmup_s=round(start["seconds"] - first, 1))


def settings_of(argv, world):
    """(TrainConfig, ModelConfig) of train.py's argv as train.py resolves them on `world` processes."""
    values = train.SETTINGS.resolve(train.SETTINGS.parse(argv))
    config, cfg = train.SETTINGS.build(train.TrainConfig, values), train.SETTINGS.build(train.ModelConfig, values)
    guards.derive_grad_accum(config, world)
    return config, cfg


def predicted_bytes(argv, device, world=1):
    """The planner's bytes for this run: tooling.memory.run_bytes of its largest shape, as train.py's check."""
    import torch
    config, cfg = settings_of(argv, world)
    use_bf16 = config.dtype == "bfloat16" or (config.dtype == "auto" and device == "cuda")  # distributed.precision
    items = [memory.run_bytes(shape, config, torch.device(device), use_bf16, world)
             for _, shape in grow.shapes_of_run(cfg, config)]
    return max(items, key=lambda i: i["need"])


def measure(check, stage, name, argv, timeout, variant="eager", timed=True, env=None, launcher=None, world=1,
            log_as=None):
    """One train.py run into the scratch folder (out/<stage>_<name>_<variant>): its command's result, then
    (timed) its throughput and its peak memory against the planner's estimate. log_as: its log's name."""
    flags = {"eager": [], "compile": ["--compile=True"], "triton": ["--triton=True"]}[variant]
    run_name = f"{stage}_{name}_{variant}"
    out_dir = os.path.join(check.scratch, "out")
    argv = [*argv, *flags, f"--device={check.device}", f"--out_dir={out_dir}", f"--run_name={run_name}"]
    if check.dry_run and variant == "compile":
        env = dict(env or {}, TORCH_COMPILE_DISABLE="1")  # inductor on this CPU takes minutes: the plumbing only
    if check.dry_run and variant == "triton":  # the interpreter (minutes per Muon step): AdamW, shorter windows
        env = dict(env or {}, TRITON_INTERPRET="1")
        argv = [*argv, "--optimizer=adamw", "--block_size=64", "--avg_doc_len=32", "--eval_tokens=64"]
    result, _ = check.command(stage, log_as or f"{name}_{variant}",
                              [*(launcher or [sys.executable]), "train.py", *argv], timeout, env)
    result = dict(run=log_as or name, variant=variant, **result)
    rows = read_log(os.path.join(out_dir, run_name, "log.jsonl"))
    if rows:
        result.update(last_step=rows[-1]["step"], val_loss=round(rows[-1]["val_loss"], 4))
        result["ok"] = result["ok"] and all(math.isfinite(r["val_loss"]) for r in rows)
    if not timed:
        return result
    config, _ = settings_of(argv, world)
    result.update(micro_batch=config.batch_size, grad_accum=config.grad_accum)
    speed = throughput(rows, WARMUP if not check.dry_run else 1, check.peak_flops)
    result.update(speed or {})
    need = predicted_bytes(argv, check.device, world)
    peak = max((r["peak_memory_gb"] for r in rows if "peak_memory_gb" in r), default=None)
    result.update(peak_memory_gib=peak and round(peak, 2), predicted_memory_gib=round(need["need"] / GIB, 2),
                  predicted_states_gib=round(need["states"] / GIB, 2),
                  predicted_activations_gib=round(need["activations"] / GIB, 2),
                  memory_ratio=peak and round(peak * GIB / need["need"], 3))
    result["ok"] = result["ok"] and speed is not None
    return result


def steps(check):
    """train.py flags of a throughput run: WARMUP steps, then TIMED, an eval (one window) at each end; the LR
    warms up over the whole run (a config's own warmup is longer than a benchmark: train.py refuses that)."""
    if check.dry_run:
        return ["--max_steps=3", "--warmup_steps=3", "--eval_interval=1", "--log_interval=1"]
    return [f"--max_steps={WARMUP + TIMED}", f"--warmup_steps={WARMUP + TIMED}", f"--eval_interval={WARMUP}",
            f"--log_interval={WARMUP}"]


NO_CHECKPOINTS = ["--save_checkpoints=False"]  # x_d8 writes ~2 GB per checkpoint; s95 47 GB sharded + 16 GB


def refused(name, variant, why):
    return dict(run=name, variant=variant, ok=False, status=None, seconds=0, error=why)


# ----------------------------------------------------------------------------------------------------
# The stages: each (check, cap) -> its dict


def stage_env(check, cap):
    probe = ("import json, os, torch\n"
             "info = dict(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),"
             " cpus=os.cpu_count())\n"
             "try:\n    import triton\n    info['triton'] = triton.__version__\nexcept ImportError:\n"
             "    info['triton'] = None\n"
             "if torch.cuda.is_available():\n"
             "    p = torch.cuda.get_device_properties(0)\n"
             "    info.update(gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],"
             " capability=list(torch.cuda.get_device_capability(0)), memory_gib=round(p.total_memory / 2**30, 1),"
             " nccl='.'.join(map(str, torch.cuda.nccl.version())))\n"
             "print(json.dumps(info))\n")
    result, text = check.command("env", "env", [sys.executable, "-c", probe], cap)
    info = json.loads(text.strip().splitlines()[-1]) if result["ok"] else {}
    free = {where: round(shutil.disk_usage(path).free / GIB, 1) for where, path in (("repo", REPO),
                                                                                     ("scratch", check.scratch))}
    ok = result["ok"] and (check.dry_run or (info.get("cuda_available") and min(free.values()) >= 10))
    return dict(ok=bool(ok), **info, disk_free_gib=free, peak_flops=check.peak_flops, commands=[result])


def pytest_counts(text):
    """{"passed": n, "failed": n, "skipped": n, ...} from pytest's last line."""
    return {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", text)}


def stage_correctness(check, cap):
    """tests/test_cuda.py (the grouped GEMM against the per-expert loop; none may skip on a GPU), then the
    kernel tests compiled for this GPU (the Triton interpreter on a CPU: one of them in a dry run)."""
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]  # -q: pytest.ini
    kernels = ["-k", "test_moe_experts_twin_is_model_run_experts"] if check.dry_run else ["-k", "kernel or apply"]
    runs = []
    for name, args, limit in (("cuda_tests", ["tests/test_cuda.py"], 60),
                              ("kernel_tests", ["tests/test_kernels.py", "tests/test_model.py", *kernels], 120)):
        left = cap - sum(r["seconds"] for r in runs)
        result, text = check.command("correctness", name, pytest + args, min(limit, left))
        result.update(pytest_counts(text))
        if name == "cuda_tests" and not check.dry_run:
            result["ok"] = result["ok"] and result.get("skipped", 0) == 0 and result.get("passed", 0) > 0
        runs.append(result)
    return dict(ok=all(r["ok"] for r in runs), commands=runs)


def stage_distributed(check, cap):
    """torchrun on every GPU: DDP (2 GPUs or more) and FSDP2 stopped at step 3 with a sharded checkpoint,
    then resumed to step 6. On one GPU that is a one-process NCCL group: FSDP2's all-gathers and
    reduce-scatters run as one-rank NCCL calls and the sharded checkpoint is written and read back on CUDA;
    no data crosses GPUs, and DDP and train.py's all_reduce (a no-op alone) are not exercised."""
    import torch
    gpus = 1 if check.dry_run else torch.cuda.device_count()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    data = check.prepared("gpt2-4096")
    common = [f"--data_dir={data}", "--eval_tokens=128", "--batch_size=4", "--parallel=fsdp", "--max_steps=6",
              "--warmup_steps=2", "--eval_interval=3"]
    runs, t0 = [], time.monotonic()

    def left():
        return cap - (time.monotonic() - t0)
    if gpus >= 2:
        runs.append(measure(check, "distributed", "ddp", [f"--data_dir={data}", "--eval_tokens=128", "--max_steps=4",
                                                          "--warmup_steps=2", "--eval_interval=2"], min(60, left()), timed=False,
                            launcher=torchrun, world=gpus))
    runs.append(measure(check, "distributed", "fsdp", [*common, "--stop_at_step=3"], min(60, left()), timed=False,
                        launcher=torchrun, world=gpus))
    run_dir = os.path.join(check.scratch, "out", "distributed_fsdp_eager")
    sharded = os.path.join(run_dir, "ckpt.dcp")
    runs[-1]["checkpoint_mib"] = round(folder_bytes(sharded) / 2 ** 20, 1) if os.path.isdir(sharded) else None
    resumed = measure(check, "distributed", "fsdp", [*common, "--init_from=resume"], min(60, left()), timed=False,
                      launcher=torchrun, world=gpus, log_as="fsdp_resume")
    steps_logged = [r["step"] for r in read_log(os.path.join(run_dir, "log.jsonl"))]
    resumed["ok"] = resumed["ok"] and steps_logged == [0, 3, 6]
    runs.append(resumed)
    collectives = (f"NCCL on {gpus} GPUs: DDP all-reduces, FSDP2 all-gathers and reduce-scatters across GPUs"
                   if gpus >= 2 else "NCCL, one process: FSDP2's all-gathers and reduce-scatters as one-rank calls; "
                   "no data crosses GPUs; DDP and train.py's all_reduce (a no-op alone) not exercised")
    return dict(ok=all(r["ok"] for r in runs) and runs[-2]["checkpoint_mib"] is not None, gpus=gpus,
                collectives=collectives if not check.dry_run else "gloo, one CPU process (dry run)", runs=runs)


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def timed_runs(check, stage, name, argv, variants, cap, world=1):
    """measure() of each variant in turn within the stage's cap (a variant with under 10 s left is skipped)."""
    runs, t0 = [], time.monotonic()
    for variant, limit in variants:
        left = cap - (time.monotonic() - t0)
        if left < 10:
            runs.append(refused(name, variant, f"skipped: the stage's {cap:.0f} s were spent"))
            continue
        runs.append(measure(check, stage, name, argv, min(limit, left), variant, world=world))
    return runs


def stage_tiny(check, cap):
    """The tiny default (the SMELT-looped MoE, FlexAttention with the document mask on CUDA), eager and
    compiled."""
    argv = [f"--data_dir={check.prepared('gpt2-4096')}", "--eval_tokens=128", *steps(check),
            *NO_CHECKPOINTS, *(["--batch_size=4"] if check.dry_run else [])]
    runs = timed_runs(check, "tiny", "tiny", argv, (("eager", 60), ("compile", 120)), cap)
    return dict(ok=all(r["ok"] for r in runs), runs=runs)


X_TOY = ["--n_embd=128", "--n_head=2", "--block_size=256", "--batch_size=2", "--global_batch=4", "--eval_tokens=256"]
S_TOY = ["--n_layer=4", "--loop_span=2", "--n_embd=64", "--n_head=2", "--n_kv_head=1", "--head_dim=32", "--n_expert=8",
         "--top_k=2", "--expert_hidden=32", "--block_size=256", "--avg_doc_len=128", "--batch_size=2",
         "--global_batch=4", "--eval_tokens=256"]


def stage_x_d8(check, cap):
    """[X] d8 Loop-2 (11 executed blocks of width 1024, context 2048) at one GPU's share of the 8-GPU recipe:
    micro-batch 16 x 2 (global_batch 32), eager, compiled and with the Triton kernels."""
    runs = timed_runs(check, "x_d8", "x_d8_loop2", x_d8_argv(check), (("eager", 60), ("compile", 150), ("triton", 90)),
                      cap)
    return dict(ok=all(r["ok"] for r in runs), runs=runs)


def x_d8_argv(check):
    size = X_TOY if check.dry_run else ["--batch_size=16", "--global_batch=32", "--eval_tokens=2048"]
    return ["config/x_d8_loop2.py", f"--data_dir={check.prepared('gpt2')}", *size, "--final_eval_tokens=0",
            *steps(check), *NO_CHECKPOINTS]


def s95_argv(check):
    size = S_TOY if check.dry_run else ["--batch_size=2", "--global_batch=4", "--eval_tokens=4096"]
    return ["config/smelt_200m_s95.py", f"--data_dir={check.prepared('gpt2-4096')}", *size, "--save_steps=[]",
            "--final_eval_tokens=0", *steps(check), *NO_CHECKPOINTS]


def stage_s95(check, cap):
    """The [S] 200M-S95 twin (3.9B parameters, 288 experts top-8, 18 executed layers, context 4096) in one
    process (FSDP2 over a one-process group, its config's parallel), micro-batch 2 x 2; eager and with the
    Triton kernels; then its dense twin (the same model with one SwiGLU of top_k x expert_hidden per layer:
    the same active FLOPs per token) eager: the MoE step's tokens/s against the dense one's."""
    argv = s95_argv(check)
    t0 = time.monotonic()
    runs = timed_runs(check, "s95", "s95", argv, (("eager", 100), ("triton", 100)), cap)
    _, cfg = settings_of(argv, 1)
    dense = [*argv, "--n_expert=0", f"--mlp_hidden={cfg.top_k * cfg.expert_hidden}"]
    runs += timed_runs(check, "s95", "s95_dense", dense, (("eager", 60),), cap - (time.monotonic() - t0))
    moe, twin = runs[0], runs[-1]
    out = dict(ok=all(r["ok"] for r in runs), runs=runs)
    if moe.get("tokens_per_s") and twin.get("tokens_per_s"):
        out["moe_vs_dense"] = dict(moe_tokens_per_s=moe["tokens_per_s"], dense_tokens_per_s=twin["tokens_per_s"],
                                   moe_step_time_over_dense=round(twin["tokens_per_s"] / moe["tokens_per_s"], 3))
    return out


def stage_s95_compile(check, cap):
    """The [S] twin compiled (not in `all`: inductor on 18 executed MoE layers takes minutes)."""
    runs = timed_runs(check, "s95_compile", "s95", s95_argv(check), (("compile", 240),), cap)
    return dict(ok=all(r["ok"] for r in runs), runs=runs)


RUNNERS = {name: globals()[f"stage_{name}"] for name in STAGES}


def run_stage(check, name):
    """The stage's one dict, within its cap and the invocation's deadline."""
    stage = STAGES[name]
    cap = min(stage.cap_s, check.left())
    t0 = time.monotonic()
    if cap < 20:
        out = dict(ok=False, skipped=f"the {check.deadline_s:g} s deadline of this invocation was reached")
    else:
        try:
            out = RUNNERS[name](check, cap)
        except Exception as e:  # one stage's failure is its line, not the end of the others
            out = dict(ok=False, error=f"{type(e).__name__}: {e}"[:300])
    line = dict(stage=name, ok=out.pop("ok"), seconds=round(time.monotonic() - t0, 1), estimate_s=stage.estimate_s,
                cap_s=stage.cap_s, device=check.device, **({"dry_run": True} if check.dry_run else {}), **out)
    return line


def main(argv=None):
    parser = common.parser("bench/gpu_check.sh", description="The first run on a lent GPU, in stages (see its header).")
    parser.add_argument("stages", nargs="+", help=f"all, or some of: {', '.join(STAGES)}")
    parser.add_argument("--dry-run", action="store_true", help="on this CPU at toy sizes: the plumbing only")
    parser.add_argument("--deadline", type=common.number(float, 0, open_low=True), default=DEADLINE_S,
                        help=f"seconds for all stages together (default {DEADLINE_S})")
    parser.add_argument("--peak_tflops", type=common.number(float, 0, open_low=True), default=PEAK_FLOPS / 1e12,
                        help=f"the GPU's dense bf16 peak for MFU (default {PEAK_FLOPS / 1e12:g}: an H200 SXM)")
    args = parser.parse_args(argv)
    names = [n for n, s in STAGES.items() if not s.extra] if args.stages == ["all"] else args.stages
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        parser.error(f"unknown stage {unknown[0]!r}; choose all or some of {', '.join(STAGES)}")
    check = Check(os.environ.get("OUT", "out"), args.dry_run, args.deadline, args.peak_tflops * 1e12)
    os.makedirs(check.logs, exist_ok=True)
    ok = True
    try:
        for name in names:
            line = run_stage(check, name)
            ok = ok and line["ok"]
            text = json.dumps(line)
            print(text, flush=True)
            with open(os.path.join(check.logs, "summary.jsonl"), "a") as f:
                f.write(text + "\n")
    finally:
        shutil.rmtree(check.scratch, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
