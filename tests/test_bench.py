"""bench/gpu_check.sh, the prepared first run on a GPU, proven on this CPU: its budget adds up, its summaries
compute what they say from train.py's log, its GPU runs fit one H200 by the planner, and its dry run (every
stage's commands at toy sizes) prints one JSON line per stage."""
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
import gpu_check  # noqa: E402

SCRIPT = os.path.join(REPO, "bench", "gpu_check.sh")


def test_the_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


def test_the_budget_fits_one_lend_with_room_to_rerun():
    """Every stage at most 4 minutes, the stages of `all` under 8 together by their estimates, and the
    script's header states each stage's estimate and cap as gpu_check.py holds them."""
    header = open(SCRIPT).read()
    core = {name: s for name, s in gpu_check.STAGES.items() if not s.extra}
    assert sum(s.estimate_s for s in core.values()) <= gpu_check.DEADLINE_S == 480
    assert list(core) == ["env", "correctness", "distributed", "tiny", "x_d8", "s95"]
    for name, stage in gpu_check.STAGES.items():
        assert stage.estimate_s <= stage.cap_s <= 240, name
        assert re.search(rf"#   {name} +{stage.estimate_s} / {stage.cap_s} ", header), name
    total = sum(s.estimate_s for s in core.values())
    assert re.search(rf"#   all +{total} / {gpu_check.DEADLINE_S}\b", header)


def log_rows():
    """A log.jsonl as train.py writes it: step 0, the end of the warm-up, two more evals."""
    rows, tokens_per_step, flops_per_token = [], 32768, 1.3e9
    for step, seconds in ((0, 0.5), (5, 70.5), (10, 72.5), (15, 74.5)):
        rows.append(dict(step=step, tokens=step * tokens_per_step, flops=step * tokens_per_step * flops_per_token,
                         seconds=seconds, val_loss=7.0, peak_memory_gb=38.0))
    return rows


def test_throughput_is_the_logs_difference_after_the_warm_up():
    speed = gpu_check.throughput(log_rows(), 5, 989.5e12)
    assert speed["timed_steps"] == 10 and speed["tokens_per_step"] == 32768
    assert speed["tokens_per_s"] == pytest.approx(10 * 32768 / 4.0, rel=1e-6)
    assert speed["mfu"] == pytest.approx(10 * 32768 * 1.3e9 / 4.0 / 989.5e12, abs=1e-4)
    assert speed["ms_per_step"] == 400.0 and speed["warmup_s"] == 70.0 and speed["flops_per_token"] == 1.3e9
    assert gpu_check.throughput(log_rows()[:2], 5, 989.5e12) is None  # no step after the warm-up
    assert gpu_check.throughput(log_rows()[:1], 5, 989.5e12) is None


def test_pytest_counts():
    assert gpu_check.pytest_counts("....s\n24 passed, 1 skipped, 146 deselected in 3.1s\n") == dict(
        passed=24, skipped=1, deselected=146)


class GPU(gpu_check.Check):
    """The real (GPU) settings, without preparing data or a scratch folder."""

    def __init__(self):
        self.dry_run, self.device, self.data = False, "cuda", {}

    def prepared(self, tokenizer):
        return f"data_{tokenizer}"


def test_the_gpu_runs_fit_one_h200_and_are_the_recipes_share():
    """The planner's estimate of each throughput run on one GPU (the figure train.py checks) leaves the 10%
    headroom of a 139 GiB H200; x_d8 runs one GPU's share of the 8-GPU recipe (16 x 2 micro-batches)."""
    check = GPU()
    runs = {"x_d8": gpu_check.x_d8_argv(check), "s95": gpu_check.s95_argv(check)}
    for name, argv in runs.items():
        for variant in ([], ["--triton=True"]):
            need = gpu_check.predicted_bytes([*argv, *variant], "cuda")["need"]
            assert need <= 0.9 * 139 * 2 ** 30, (name, variant, need / 2 ** 30)
    config, cfg = gpu_check.settings_of(runs["x_d8"], 1)
    assert (config.batch_size, config.grad_accum, cfg.block_size, cfg.executed_layers()) == (16, 2, 2048, 11)
    config, cfg = gpu_check.settings_of(runs["s95"], 1)
    assert (config.batch_size, config.grad_accum, cfg.n_expert, config.parallel) == (2, 2, 288, "fsdp_grad_op")
    assert gpu_check.settings_of([*runs["x_d8"], "--final_eval_tokens=0"], 1)[0].final_eval_tokens == 0


def test_dry_run_prints_one_json_line_per_stage(tmp_path):
    """The dry run of the stages that are quick on a CPU (the full one, `--dry-run all`, takes minutes):
    stdout holds exactly one JSON line per stage, every stage passes, its logs are kept, its scratch is gone."""
    stages, scratch = ["env", "distributed", "tiny"], tmp_path / "tmp"
    scratch.mkdir()
    run = subprocess.run(["bash", SCRIPT, "--dry-run", *stages], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, OUT=str(tmp_path), TMPDIR=str(scratch)), timeout=240)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stderr[-2000:] + run.stdout[-2000:]
    assert [json.loads(line)["stage"] for line in lines] == stages
    for line in map(json.loads, lines):
        assert line["ok"] and line["dry_run"] and line["seconds"] <= line["cap_s"], line
    tiny = json.loads(lines[2])
    for r in tiny["runs"]:
        assert r["tokens_per_s"] > 0 and r["predicted_memory_gib"] > 0 and r["timed_steps"] == 2, r
        assert os.path.exists(tmp_path / "gpu_check" / r["log"])
    distributed = json.loads(lines[1])
    assert [r["run"] for r in distributed["runs"]] == ["fsdp", "fsdp_resume"]
    assert distributed["runs"][0]["checkpoint_mib"] > 0 and distributed["runs"][1]["last_step"] == 6
    summary = (tmp_path / "gpu_check" / "summary.jsonl").read_text().splitlines()
    assert summary == lines
    assert not [n for n in os.listdir(scratch) if n.startswith("gpu_check.")]  # the runs' scratch folder deleted
