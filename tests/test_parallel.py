"""DDP and FSDP2 on CPU (gloo, one torchrun launch for every job): 2 processes train what 1 process
trains with the same global batch, and sharded checkpoints resume exactly, onto 1 process too."""
import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import train
from dist_driver import muon_steps
from model import GPT, ModelConfig, load_checkpoint
from test_train import log_of  # a summary's log

SMALL = dict(n_layer=2, n_embd=32, n_head=2, n_expert=4, top_k=2, layout="smelt", n_passes=2, block_size=32,
             batch_size=4, eval_tokens=256, warmup_steps=2, eval_interval=2, max_steps=4)
PCC = dict(layout="pcc", n_layer=3, n_expert=0, n_passes=2, boundary="both", boundary_alpha=0.7)
JOBS = {"ddp_smelt_muon": dict(optimizer="muon"),
        "ddp_untied_random_passes": dict(PCC, layout="pcc_untied", n_passes_choices=[1, 2]),
        "fsdp_smelt_muon": dict(optimizer="muon", parallel="fsdp"),
        "fsdp_smelt_adamw_grad_op": dict(optimizer="adamw", parallel="fsdp_grad_op"),
        "fsdp_untied_muon_x": dict(PCC, layout="pcc_untied", optimizer="muon_x", parallel="fsdp"),
        "fsdp_grow_tied": dict(PCC, n_passes=1, grow_at=2.0, parallel="fsdp"),
        "fsdp_grow_untied": dict(PCC, layout="pcc_untied", n_passes=1, grow_at=2.0, parallel="fsdp")}
BUILDS = {"x_init_smelt": dict(layout="smelt", n_passes=2, n_expert=4, top_k=2, n_layer=4, n_embd=64,
                               n_head=2, vocab_size=512),
          "nanogpt_init_untied": dict(PCC, layout="pcc_untied", init="nanogpt", n_embd=64, vocab_size=511)}
TOL = dict(rel=1e-5, abs=1e-6)  # fp32: gradient sums in another order


@pytest.fixture(scope="module")
def two(tmp_path_factory, data_dir, torchrun):
    root = tmp_path_factory.mktemp("parallel")
    jobs = [dict(name=name, settings=SMALL | s | dict(data_dir=data_dir, out_dir=str(root / name)))
            for name, s in JOBS.items()]
    jobs += [dict(build=BUILDS[name], path=str(root / f"{name}.pt")) for name in BUILDS]
    jobs += [dict(name=f"muon_{variant}", muon=variant) for variant in ("original", "x")]
    jobs.append(dict(name="unshared", per_node=1, unshared=True,  # 2 nodes of 1, a folder each
                     settings=SMALL | dict(data_dir=data_dir, out_dir=str(root / "unshared"))))
    resumed = SMALL | dict(parallel="fsdp", decay_fraction=0.0, max_steps=2, data_dir=data_dir,
                           out_dir=str(root / "fsdp_resumed"))
    jobs.append(dict(name="fsdp_resumed", settings=resumed, then=[dict(max_steps=4)]))
    (root / "jobs.json").write_text(json.dumps(jobs))
    torchrun(["tests/dist_driver.py", str(root / "jobs.json"), str(root / "results.json")], nproc=2)
    return json.loads((root / "results.json").read_text()), root


@pytest.mark.parametrize("name", JOBS)
def test_two_processes_train_what_one_process_trains(two, tmp_path, data_dir, name):
    settings = SMALL | JOBS[name] | dict(data_dir=data_dir, out_dir=str(tmp_path), global_batch=8)
    one = train.train(settings | dict(parallel="ddp"))  # one plain process: the same initial weights too
    (result,) = two[0][name]
    assert result["train_losses"] == pytest.approx(one["train_losses"], **TOL)
    assert result["val_loss"] == pytest.approx(one["val_loss"], **TOL)
    model, ref = load_checkpoint(result["ckpt_path"])[0], load_checkpoint(one["ckpt_path"])[0]
    assert model.config == ref.config
    # Whole tensors: AdamW's first steps are near +-lr where a gradient is near 0, so a sum in another
    # order can move a single element by ~lr x its rounding.
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p - q).norm() <= 1e-5 * q.norm() + 1e-6, n


def test_a_sharded_run_resumes_exactly_on_two_processes_and_on_one(two, tmp_path, data_dir):
    results, root = two
    straight = train.train(SMALL | dict(parallel="fsdp", decay_fraction=0.0, data_dir=data_dir,
                                        global_batch=8, out_dir=str(tmp_path / "a")))
    first, second = results["fsdp_resumed"]
    assert first["train_losses"] + second["train_losses"] == pytest.approx(straight["train_losses"], **TOL)
    val = [[r["val_loss"] for r in log_of(s)] for s in (second, straight)]
    assert val[0] == pytest.approx(val[1], **TOL)
    # the 2-process ckpt.dcp/ resumed by one process: DCP re-shards it
    more = train.train(dict(out_dir=str(root / "fsdp_resumed"), init_from="resume", max_steps=6))
    again = train.train(dict(out_dir=str(tmp_path / "a"), init_from="resume", max_steps=6))
    assert more["train_losses"] == pytest.approx(again["train_losses"], **TOL)


@pytest.mark.parametrize("name", BUILDS)
def test_one_seed_draws_the_same_weights_whatever_the_parallelism(two, name):
    """GPT(cfg) in one process, and FSDP2 on one and on 2 processes: the same tensors."""
    sharded = torch.load(two[1] / f"{name}.pt", weights_only=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        one = train.build_model(ModelConfig(**BUILDS[name]), train.TrainConfig(parallel="fsdp"), False,
                                torch.device("cpu"), True)
        one = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in one.state_dict().items()}
    finally:
        dist.destroy_process_group()
    torch.manual_seed(0)
    whole = GPT(ModelConfig(**BUILDS[name])).state_dict()
    assert sharded.keys() == one.keys() == whole.keys()
    for k, w in whole.items():
        assert torch.equal(sharded[k], w) and torch.equal(one[k], w), k
        assert w.abs().max() > 0 or "o_proj" in k or "w_down" in k or "lm_head" in k, k  # drawn


@pytest.mark.parametrize("variant", ["original", "x"])
def test_muon_on_two_ddp_replicas_splits_the_orthogonalisation(two, variant):
    """Each of 2 DDP replicas orthogonalises its share of the matrices; both take one process's
    steps (atol 1e-6: the x variant may batch otherwise than one process)."""
    weights, counted = muon_steps(variant)  # one process: every matrix here
    ranks = two[0][f"muon_{variant}"]
    assert sum(count for _, count in ranks) == counted == 16  # 8 matrices, 2 steps
    assert all(0 < count < counted for _, count in ranks), ranks
    for rank_weights, _ in ranks:
        assert rank_weights == ranks[0][0]
        for w, expected in zip(rank_weights, weights):
            torch.testing.assert_close(torch.tensor(w), torch.tensor(expected), rtol=0, atol=1e-6)


def test_two_nodes_without_a_shared_folder_are_refused_at_the_start(two):
    """2 nodes of 1 process, each with its own run folder: every rank stops before writing a log."""
    results, root = two
    assert "on several nodes the run folder must be one shared folder" in results["unshared"]
    assert "1 processes do not see what rank 0 writes" in results["unshared"]
    assert not any((root / f"unshared_{rank}" / "log.jsonl").exists() for rank in (0, 1))


def test_hsdp_on_two_nodes_of_two_processes_trains_what_one_process_trains(tmp_path, data_dir, torchrun):
    """HSDP on 2 nodes of 2 processes trains what one process trains, and all-reduces across the
    nodes once a step for each sharded module (the 2 blocks and the root)."""
    settings = SMALL | dict(optimizer="muon_x", batch_size=2, global_batch=16, data_dir=data_dir)
    hsdp = settings | dict(parallel="hsdp", out_dir=str(tmp_path / "h"))
    jobs = [dict(name="hsdp", per_node=2, settings=hsdp)]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    torchrun(["tests/dist_driver.py", str(tmp_path / "jobs.json"), str(tmp_path / "results.json")], nproc=4)
    (hsdp,) = json.loads((tmp_path / "results.json").read_text())["hsdp"]
    one = train.train(settings | dict(out_dir=str(tmp_path / "one")))  # one plain process
    assert hsdp["train_losses"] == pytest.approx(one["train_losses"], **TOL)
    assert hsdp["val_loss"] == pytest.approx(one["val_loss"], **TOL)
    assert hsdp["cross_node_all_reduces"] == hsdp["step"] * 3
