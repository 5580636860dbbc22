"""DDP and FSDP2 on CPU (gloo, one torchrun launch for every job): 2 processes train exactly what 1 process
trains with the same global batch (2 micro-batches), with Muon and AdamW, on the SMELT MoE, tied and untied
prelude-core-coda, random passes and across growth; sharded checkpoints resume exactly, onto 1 process too,
and the consolidated ckpt.pt loads in one process."""
import json

import pytest

import train
from model import load_checkpoint

SMALL = dict(n_layer=2, n_embd=32, n_head=2, n_expert=4, top_k=2, layout="smelt", n_passes=2, block_size=32,
             batch_size=4, eval_tokens=256, warmup_steps=2, eval_interval=2, max_steps=4)
PCC = dict(layout="pcc", n_layer=3, n_expert=0, n_passes=2, boundary="both", boundary_alpha=0.7)
JOBS = {
    "ddp_smelt_muon": dict(optimizer="muon"),
    "ddp_untied_random_passes": dict(PCC, layout="pcc_untied", n_passes_choices=[1, 2]),
    "fsdp_smelt_muon": dict(optimizer="muon", parallel="fsdp"),
    "fsdp_smelt_adamw_grad_op": dict(optimizer="adamw", parallel="fsdp_grad_op"),
    "fsdp_untied_muon_x": dict(PCC, layout="pcc_untied", optimizer="muon_x", parallel="fsdp"),
    "fsdp_grow_tied": dict(PCC, n_passes=1, grow_at=2.0, parallel="fsdp"),
    "fsdp_grow_untied": dict(PCC, layout="pcc_untied", n_passes=1, grow_at=2.0, parallel="fsdp"),
}
TOL = dict(rel=1e-5, abs=1e-6)  # fp32: gradient sums in another order


def log_of(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def two(tmp_path_factory, data_dir, torchrun):
    root = tmp_path_factory.mktemp("parallel")
    jobs = [dict(name=name, settings=SMALL | s | dict(data_dir=data_dir, out_dir=str(root / name)))
            for name, s in JOBS.items()]
    jobs.append(dict(name="fsdp_resumed", settings=SMALL | dict(parallel="fsdp", decay_fraction=0.0, max_steps=2,
                     data_dir=data_dir, out_dir=str(root / "fsdp_resumed")), then=[dict(max_steps=4)]))
    (root / "jobs.json").write_text(json.dumps(jobs))
    torchrun(["tests/dist_driver.py", str(root / "jobs.json"), str(root / "results.json")], nproc=2)
    return json.loads((root / "results.json").read_text()), root


@pytest.mark.parametrize("name", JOBS)
def test_two_processes_train_what_one_process_trains(two, tmp_path, data_dir, name):
    settings = SMALL | JOBS[name] | dict(data_dir=data_dir, out_dir=str(tmp_path), global_batch=8)
    one = train.train(settings | dict(parallel="ddp"))
    (result,) = two[0][name]
    assert result["train_losses"] == pytest.approx(one["train_losses"], **TOL)
    assert result["val_loss"] == pytest.approx(one["val_loss"], **TOL)
    model, _ = load_checkpoint(result["ckpt_path"])  # FSDP: the consolidated weights, in one process
    ref, _ = load_checkpoint(one["ckpt_path"])
    assert model.config == ref.config
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.detach() == pytest.approx(q.detach(), rel=1e-4, abs=1e-5), n


def test_a_sharded_run_resumes_exactly_on_two_processes_and_on_one(two, tmp_path, data_dir):
    results, root = two
    straight = train.train(SMALL | dict(parallel="fsdp", decay_fraction=0.0, data_dir=data_dir, global_batch=8,
                                        out_dir=str(tmp_path / "a")))
    first, second = results["fsdp_resumed"]
    assert first["train_losses"] + second["train_losses"] == pytest.approx(straight["train_losses"], **TOL)
    strip = lambda log: [r["val_loss"] for r in log]  # noqa: E731
    assert strip(log_of(second["log_path"])) == pytest.approx(strip(log_of(straight["log_path"])), **TOL)
    # the 2-process ckpt.dcp/ resumed by one process: DCP re-shards it
    more = train.train(dict(out_dir=str(root / "fsdp_resumed"), init_from="resume", max_steps=6))
    again = train.train(dict(out_dir=str(tmp_path / "a"), init_from="resume", max_steps=6))
    assert more["train_losses"] == pytest.approx(again["train_losses"], **TOL)
