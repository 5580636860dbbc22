"""bench/bench.py and bench/gpu_check.sh on this CPU at toy sizes."""
import json
import math
import os
import re
import subprocess
import sys
import tarfile

import pytest
import torch
from test_sample import error_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
import bench  # noqa: E402


def test_bench_dry_run_prints_one_json_line_per_measurement(capsys):
    bench.main(["--dry-run", "moe", "kernels"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["stage"] for r in rows] == ["moe"] + ["kernels"] * 5
    moe = rows[0]
    assert moe["dense_hidden"] == moe["top_k"] * moe["expert_hidden"]  # equal active FLOPs
    assert abs(moe["ratio"] - moe["moe_ms"] / moe["dense_ms"]) < 0.01 * moe["ratio"]
    kernel_names = ["rmsnorm", "boundary_operator", "swiglu", "moe_experts", "gram"]
    assert [r["kernel"] for r in rows[1:]] == kernel_names
    assert all(r["max_rel_diff"] < 1e-5 for r in rows[1:]), rows  # fp32 in the interpreter: reassociation


def test_the_byte_counter_counts_inputs_and_outputs_and_no_views():
    a, b = torch.ones(8, 4), torch.ones(4, 2, dtype=torch.bfloat16)
    with bench.ByteCounter() as counter:
        c = a @ b.float()  # a cast (16 + 32 bytes), a matmul (128 + 32 + 64)
        c.t().unsqueeze(0)  # views: nothing
        c.add_(1)  # in place: read and written, 2 x 64
        c.new_zeros(3), torch.zeros_like(c)  # read only c's dtype and device: 12 and 64 written
        torch.ones(8, 1).expand(8, 2).neg()  # an expanded input's 8 distinct floats read (32), 64 written
    assert counter.by_op == {"_to_copy.default": 48, "mm.default": 224, "add_.Tensor": 128,
                             "new_zeros.default": 12, "zeros_like.default": 64, "ones.default": 32,
                             "neg.default": 96}


def test_the_default_run_is_the_cpu_stages(monkeypatch):
    ran = []
    stages = {name: lambda *args, name=name: ran.append(name) for name in bench.STAGES}
    monkeypatch.setattr(bench, "STAGES", stages)
    bench.main([])
    assert ran == ["efficiency", "moe", "moe_bytes", "moe_bytes_compiled", "kernels"]


def test_the_moe_moves_at_most_0_553_mb_per_token_eager_and_0_5_compiled_at_the_s95_widths(capsys):
    """Eager: shapes only, the CUDA path's bytes (1.11 MB before the lean pass, 0.552 after).
    Compiled, by Inductor's own count: 0.433."""
    bench.main(["moe_bytes", "moe_bytes_compiled"])
    eager, compiled = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for row in (eager, compiled):
        assert row["n_embd"] == 1056 and row["n_expert"] == 288 and row["tokens"] == 16384
    assert eager["gemm_mflop_per_token"] == 53.5 and eager["mb_per_token"] <= 0.553
    assert abs(eager["gemm_flop_per_byte"] - 53.5 / eager["mb_per_token"]) < 0.2
    assert 0.3 < compiled["mb_per_token"] <= 0.5  # the grouped GEMMs alone move 0.27


def test_efficiency_counts_flops_per_layout_against_plain_and_gpt2(capsys, monkeypatch):
    monkeypatch.setattr(bench, "LAYOUTS", {k: bench.LAYOUTS[k] for k in ("plain", "smelt_r2", "moe_8e_top2")})
    bench.main(["--dry-run", "efficiency"])
    rows = {r["model"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert list(rows) == ["plain", "smelt_r2", "moe_8e_top2", "gpt2"]
    assert rows["plain"]["vs_plain"] == 1.0 and rows["gpt2"]["vs_gpt2"] == 1.0
    for name in ("smelt_r2", "moe_8e_top2", "gpt2"):  # GFLOP/s = the analytic FLOPs of a step over its time
        assert rows[name]["gflops"] > 0
        for ref in ("plain", "gpt2"):
            expected = rows[name]["gflops"] / rows[ref]["gflops"]
            assert abs(rows[name][f"vs_{ref}"] - expected) < 0.01 * expected + 1e-3


def test_the_gpt2_twin_steps_and_counts_its_flops_as_match_py_counts_ours():
    """Both sides of vs_gpt2 count FLOPs one way: FlopCounterMode's matmuls (it has no formula for SDPA on
    CPU) plus match.py's attention and norms. Our SwiGLU is 176 wide, so the MLPs differ."""
    from torch.utils.flop_counter import FlopCounterMode
    import match
    from model import GPT, ModelConfig
    cfg = ModelConfig(vocab_size=256, block_size=32, n_embd=64, n_layer=2, n_head=4)
    assert cfg.mlp_hidden == 176
    tokens, d, L = 2 * 32, 64, 2
    attention_and_norms = 3 * (4 * d * match.resolve_attended(cfg) * L + 4 * d * (2 * L + 1))
    for build, flops in ((GPT, match.flops_per_token), (bench.GPT2, bench.gpt2_flops_per_token)):
        step = bench.train_step(cfg, dict(batch=2), "cpu", build, flops)
        with FlopCounterMode(display=False) as counter:
            step()
        counted = counter.get_total_flops() + tokens * attention_and_norms
        assert step.flops == pytest.approx(counted, rel=1e-12)
    assert counter.get_total_flops() == 6 * tokens * (12 * d * d * L + d * 256)  # GPT-2's matmuls, tied head
    twin = bench.GPT2(cfg)
    logits, loss = twin(torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32)))
    assert logits.shape == (2, 32, 256) and abs(loss.item() - math.log(256)) < 0.5  # nanoGPT's small init


def test_a_bad_stage_is_one_line_with_status_2(capsys):
    assert "error: unknown stage 'nope'" in error_line(bench.main, ["nope"], capsys, "bench/bench.py")


def test_gpu_check_dry_run_writes_its_summary_and_logs(tmp_path):
    script = os.path.join(REPO, "bench", "gpu_check.sh")
    subprocess.run(["bash", "-n", script], check=True)
    run = subprocess.run(["bash", script, "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OUT=str(tmp_path)))
    assert sorted(os.listdir(tmp_path)) == ["logs.tar.gz", "summary.jsonl"]  # a lend returns at most 8 files
    summary = [json.loads(line) for line in (tmp_path / "summary.jsonl").read_text().splitlines()]
    assert run.stdout.splitlines() == [json.dumps(row) for row in summary]
    status = {row["stage"]: row["rc"] for row in summary if "rc" in row}
    assert status == dict(env=0, d8=0, train=0, s95=0, tests=0, d8_eager=0), run.stdout
    rows = {}
    for row in summary[1:]:  # after env's line, the measurements' lines by stage
        rows.setdefault(row["stage"] if "rc" not in row else "rc", []).append(row)
    assert [r["compiled"] for r in rows["profile_d8"]] == [True, False]  # the compiled step first
    assert rows["profile_d8"][0]["graphs"] == 2 and rows["profile_d8"][0]["graph_breaks"] == 0
    assert [(r["model"], r["checkpointing"]) for r in rows["s95_sharded"]] == [
        ("s95", True), ("s95", False), ("base", True), ("base", False)]
    assert all(r["mfu_of_matmul"] > 0 for r in rows["profile_d8"] + rows["s95_sharded"])
    assert rows["resume"][0]["exact"] and rows["resume"][0]["tokens_per_s"] > 0
    assert summary[0]["torch"] == __import__("torch").__version__ and summary[0]["gpu"] is None
    with tarfile.open(tmp_path / "logs.tar.gz") as logs:
        assert {os.path.basename(n) for n in logs.getnames()} >= {f"{stage}.txt" for stage in status}


def test_gpu_check_runs_train_py_with_its_own_settings():
    """The GPU-only stages' train.py command lines use settings train.py has (its --help lists them)."""
    import train
    keys = re.findall(r"--(\w+)=", open(os.path.join(REPO, "bench", "gpu_check.sh")).read())
    assert {"max_steps", "data_dir", "out_dir"} <= set(keys) <= set(train.DEFAULTS)
