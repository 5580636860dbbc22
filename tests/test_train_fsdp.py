"""train.py --parallel=fsdp on CPU (gloo): 2 processes train exactly what 1 process trains with the same
global batch (grad_accum=2), with Muon and AdamW, on the SMELT-looped MoE, tied and untied
prelude-core-coda, and across a growth step; sharded checkpoints resume exactly, onto another world
size too; the consolidated checkpoint loads in one process; each rank holds half the state, as the planner
(tooling/memory.py) predicts. One torchrun launch runs all FSDP jobs (tests/fsdp_driver.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import train
from tooling import memory
from tooling.checkpoint import load_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(n_layer=2, n_embd=32, n_head=2, n_expert=4, top_k=2, layout="smelt", n_passes=2, block_size=32,
             batch_size=4, eval_tokens=256, warmup_steps=2, eval_interval=1, max_steps=4)
PCC = dict(layout="pcc", n_layer=3, n_expert=0, n_passes=2, boundary="both", boundary_alpha=0.7)
JOBS = {
    "smelt_muon": dict(optimizer="muon"),
    "smelt_adamw": dict(optimizer="adamw"),
    "pcc_tied_muon": dict(PCC, optimizer="muon"),
    "pcc_untied_adamw": dict(PCC, tie_core=False, optimizer="adamw"),
    "grow_tied_muon": dict(PCC, n_passes=1, grow_at=2.0, grow_to=2, optimizer="muon"),
    "grow_untied_adamw": dict(PCC, n_passes=1, grow_at=2.0, grow_to=2, grow_untie=True, optimizer="adamw"),
}
TOL = dict(rel=1e-5, abs=1e-6)  # fp32: gradient sums in another order, the same Newton-Schulz inputs


def log_of(summary):
    return [json.loads(line) for line in open(summary["log_path"])]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory, data_dir, torchrun):
    """Every FSDP job, run once by 2 torchrun processes; returns (results, out root)."""
    root = tmp_path_factory.mktemp("fsdp")
    jobs = [dict(name=name, settings=SMALL | settings | dict(parallel="fsdp", data_dir=data_dir,
                                                            out_dir=str(root / name)), measure=name == "smelt_muon")
            for name, settings in JOBS.items()]
    jobs.append(dict(name="resumed", settings=SMALL | dict(parallel="fsdp", data_dir=data_dir, stop_at_step=2,
                                                          out_dir=str(root / "resumed")), then=[dict()]))
    jobs.append(dict(name="checkpointed", settings=SMALL | dict(parallel="fsdp", data_dir=data_dir,
                                                               activation_checkpointing=True,
                                                               out_dir=str(root / "checkpointed"))))
    jobs.append(dict(name="bf16", settings=SMALL | dict(parallel="fsdp", data_dir=data_dir, dtype="bfloat16",
                                                       out_dir=str(root / "bf16"))))
    (root / "jobs.json").write_text(json.dumps(jobs))
    torchrun(["tests/fsdp_driver.py", str(root / "jobs.json"), str(root / "results.json")], nproc=2)
    return json.loads((root / "results.json").read_text()), root


@pytest.mark.parametrize("name", JOBS)
def test_two_fsdp_processes_equal_one_process_with_accumulation(fsdp, tmp_path, data_dir, name):
    results, _ = fsdp
    one = train.train(SMALL | JOBS[name] | dict(data_dir=data_dir, out_dir=str(tmp_path), global_batch=8))
    two = results[name]["summaries"][0]
    log_one, log_two = log_of(one), log_of(two)
    assert [r["tokens"] for r in log_two] == [r["tokens"] for r in log_one]  # the same global batch
    for a, b in zip(log_one, log_two):
        assert b["val_loss"] == pytest.approx(a["val_loss"], **TOL), (name, a["step"])
        if a["train_loss"] is not None:
            assert b["train_loss"] == pytest.approx(a["train_loss"], **TOL), (name, a["step"])
    if name.startswith("grow"):
        grown, _ = load_model(two["ckpt_path"])  # the consolidated file after growth
        assert grown.config.n_passes == 2 and grown.config.tie_core == (name == "grow_tied_muon")


def test_sharded_save_resume_gives_the_identical_curve(fsdp):
    results, _ = fsdp
    first, second = results["resumed"]["summaries"]
    assert first["step"] == 2 and first["resume_path"].endswith("ckpt.dcp") and second["step"] == 4
    straight = results["smelt_muon"]["summaries"][0]
    assert first["train_losses"] + second["train_losses"] == straight["train_losses"]  # same ops, same machine
    assert [r["val_loss"] for r in log_of(second)] == [r["val_loss"] for r in log_of(straight)]


def test_activation_checkpointing_gives_the_same_training(fsdp):
    results, _ = fsdp
    assert results["checkpointed"]["summaries"][0]["train_losses"] == \
        pytest.approx(results["smelt_muon"]["summaries"][0]["train_losses"], rel=1e-6)


def test_bf16_autocast_under_fsdp_trains(fsdp):
    """The CUDA default dtype on the FSDP path, rehearsed with 2 CPU processes: finite and falling."""
    results, _ = fsdp
    summary = results["bf16"]["summaries"][0]
    log = log_of(summary)
    assert all(r["val_loss"] == r["val_loss"] for r in log) and log[-1]["val_loss"] < log[0]["val_loss"]
    fp32 = results["smelt_muon"]["summaries"][0]
    assert summary["val_loss"] == pytest.approx(fp32["val_loss"], rel=0.02)  # bf16 rounding, not another run


def test_consolidated_checkpoint_loads_in_one_process_with_the_sharded_logits(fsdp):
    results, root = fsdp
    model, ckpt = load_model(results["smelt_muon"]["summaries"][0]["ckpt_path"])
    assert ckpt["optimizer"] is None and ckpt["state"]["step"] == 4  # weights only: the optimizer state stays sharded
    idx = torch.arange(2 * 16).reshape(2, 16) % (model.config.vocab_size - 1)
    with torch.no_grad():
        logits = model(idx)[0]
    torch.testing.assert_close(logits, torch.load(root / "smelt_muon" / "sharded_logits.pt"), rtol=1e-5, atol=1e-6)


def test_each_rank_holds_half_the_state_as_the_planner_predicts(fsdp):
    results, _ = fsdp
    cfg = train.SETTINGS.build(train.ModelConfig, train.DEFAULTS | SMALL)
    per_rank = results["smelt_muon"]["state_bytes"]
    total = memory.state_bytes_per_rank(cfg, 1, "muon")
    assert per_rank[0] == memory.state_bytes_per_rank(cfg, 2, "muon")  # rank 0 holds the larger halves
    assert sum(per_rank) == total
    assert all(abs(b / (total / 2) - 1) < 0.03 for b in per_rank), (per_rank, total)


def test_resume_onto_other_world_sizes(fsdp, tmp_path, torchrun):
    """The 2-process sharded checkpoint continues in 3 FSDP processes (uneven shards) and in one plain
    process: DCP re-shards on load. One process keeps the run's global batch (grad_accum follows); three
    cannot (8 sequences over 3) and change it only when told to (--global_batch=12)."""
    import shutil
    results, root = fsdp
    for target, nproc in (("three", 3), ("one", 1)):
        shutil.copytree(root / "resumed", tmp_path / target)
        overrides = dict(out_dir=str(tmp_path / target), init_from="resume", max_steps=6)
        if nproc == 3:
            argv = ["train.py", *[f"--{k}={v!r}" for k, v in overrides.items()]]
            refused = torchrun(argv, nproc=3, check=False)
            assert refused.returncode != 0 and "global_batch=8 (the sequences per step of the run it continues) " \
                "is not a multiple of batch_size x processes = 4 x 3" in refused.stderr
            torchrun(argv + ["--global_batch=12"], nproc=3)
        else:
            train.train(overrides | dict(parallel="ddp"))
        log = [json.loads(line) for line in open(tmp_path / target / "tiny" / "log.jsonl")]
        assert [r["step"] for r in log] == [0, 1, 2, 3, 4, 5, 6]
        assert all(r["val_loss"] == r["val_loss"] for r in log) and log[-1]["val_loss"] < log[0]["val_loss"]
        per_step = [b["tokens"] - a["tokens"] for a, b in zip(log, log[1:])]
        at = [json.loads(line) for line in open(root / "resumed" / "tiny" / "log.jsonl")][-1]["step"]
        block = per_step[0] // 8
        assert per_step == [8 * block] * at + [(12 if nproc == 3 else 8) * block] * (6 - at)


def test_bad_parallel_requests_fail_clearly(tmp_path, data_dir):
    with pytest.raises(ValueError, match="parallel='zero3': must be one of 'ddp', 'fsdp'"):
        train.train(SMALL | dict(parallel="zero3", data_dir=data_dir, out_dir=str(tmp_path)))
    # without torchrun, --parallel=fsdp runs as one shard in a one-process group
    result = subprocess.run([sys.executable, "train.py", "--parallel=fsdp", f"--data_dir={data_dir}",
                             f"--out_dir={tmp_path}", "--max_steps=2", *[f"--{k}={v!r}" for k, v in SMALL.items()
                                                                         if k != "max_steps"]],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world_size 1 (FSDP)" in result.stdout and os.path.isdir(tmp_path / "tiny" / "ckpt.dcp")
