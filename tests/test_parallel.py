"""DDP and FSDP2 on CPU (gloo, one torchrun launch for every job): 2 processes train exactly what 1 plain
process trains with the same global batch (2 micro-batches), from the same initial weights, with Muon and AdamW,
on the SMELT MoE, tied and untied prelude-core-coda, random passes and across growth; sharded checkpoints
resume exactly, onto 1 process too, and the consolidated ckpt.pt loads in one process."""
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
BUILDS = {"x_init_smelt": dict(layout="smelt", n_passes=2, n_expert=4, top_k=2, n_layer=4, n_embd=64, n_head=2,
                               vocab_size=512),
          "nanogpt_init_untied": dict(PCC, layout="pcc_untied", init="nanogpt", n_embd=64, vocab_size=511)}
TOL = dict(rel=1e-5, abs=1e-6)  # fp32: gradient sums in another order


def log_of(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def two(tmp_path_factory, data_dir, torchrun):
    root = tmp_path_factory.mktemp("parallel")
    jobs = [dict(name=name, settings=SMALL | s | dict(data_dir=data_dir, out_dir=str(root / name)))
            for name, s in JOBS.items()]
    jobs += [dict(build=BUILDS[name], path=str(root / f"{name}.pt")) for name in BUILDS]
    jobs += [dict(name=f"muon_{variant}", muon=variant) for variant in ("original", "x")]
    jobs.append(dict(name="unshared", per_node=1, unshared=True,  # 2 nodes of 1, a folder each
                     settings=SMALL | dict(data_dir=data_dir, out_dir=str(root / "unshared"))))
    jobs.append(dict(name="fsdp_resumed", settings=SMALL | dict(parallel="fsdp", decay_fraction=0.0, max_steps=2,
                     data_dir=data_dir, out_dir=str(root / "fsdp_resumed")), then=[dict(max_steps=4)]))
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
    model, _ = load_checkpoint(result["ckpt_path"])  # FSDP: the consolidated weights, in one process
    ref, _ = load_checkpoint(one["ckpt_path"])
    assert model.config == ref.config
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        # as a whole tensor: AdamW's first steps are near +-lr wherever a gradient is near 0 (a rare token's
        # embedding), so a reduction in another order can move a single element by ~lr x its rounding
        assert (p - q).norm() <= 1e-5 * q.norm() + 1e-6, n


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


@pytest.mark.parametrize("name", BUILDS)
def test_one_seed_draws_the_same_weights_whatever_the_parallelism(two, name):
    """One process (GPT(cfg), as train.py builds it for DDP), FSDP2 on one process and FSDP2 on 2 processes
    (built on the meta device, sharded, each parameter drawn whole and cut): the same tensors."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from model import GPT, ModelConfig
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
        assert w.abs().max() > 0 or "o_proj" in k or "w_down" in k or "lm_head" in k, k  # drawn, not left empty


@pytest.mark.parametrize("variant", ["original", "x"])
def test_muon_on_two_ddp_replicas_splits_the_orthogonalisation(two, variant):
    """Muon on plain tensors under 2 processes (DDP replicas): each rank orthogonalises its share of the
    matrices only, and both take the single-process steps. The owner runs the same Newton-Schulz as one
    process (bf16, as on CUDA) and broadcasts its result, so the ranks agree exactly; atol 1e-6 on O(1)
    weights allows a batch of the x variant cut otherwise than in one process (0 difference observed)."""
    import torch
    from dist_driver import muon_steps
    weights, counted = muon_steps(variant)  # one process: every matrix here
    ranks = two[0][f"muon_{variant}"]
    assert sum(count for _, count in ranks) == counted == 16  # 8 matrices, 2 steps
    assert all(0 < count < counted for _, count in ranks), ranks
    for rank_weights, _ in ranks:
        assert rank_weights == ranks[0][0]
        for w, expected in zip(rank_weights, weights):
            torch.testing.assert_close(torch.tensor(w), torch.tensor(expected), rtol=0, atol=1e-6)


def test_two_nodes_without_a_shared_folder_are_refused_at_the_start(two):
    """2 processes taken as 2 nodes, each seeing only its own run folder: every rank stops with one line
    before the run writes its log."""
    results, root = two
    assert "on several nodes the run folder must be one shared folder" in results["unshared"]
    assert "1 processes do not see what rank 0 writes" in results["unshared"]
    assert not any((root / f"unshared_{rank}" / "log.jsonl").exists() for rank in (0, 1))


def test_hsdp_on_two_nodes_of_two_processes_trains_what_one_process_trains(tmp_path, data_dir, torchrun):
    """--parallel=hsdp on 4 processes taken as 2 nodes of 2 (LOCAL_WORLD_SIZE=2): shards within a node,
    replicas across them; Muon's x variant orthogonalises on the shard dim of the 2-D mesh. The same losses
    as one process with the same global batch. Of 2 micro-batches a step, only the last all-reduces across
    the nodes: once a step for each sharded module (the 2 blocks and the root)."""
    settings = SMALL | dict(optimizer="muon_x", batch_size=2, global_batch=16, data_dir=data_dir)
    jobs = [dict(name="hsdp", per_node=2, settings=settings | dict(parallel="hsdp", out_dir=str(tmp_path / "h")))]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    torchrun(["tests/dist_driver.py", str(tmp_path / "jobs.json"), str(tmp_path / "results.json")], nproc=4)
    (hsdp,) = json.loads((tmp_path / "results.json").read_text())["hsdp"]
    one = train.train(settings | dict(out_dir=str(tmp_path / "one")))  # one plain process
    assert hsdp["train_losses"] == pytest.approx(one["train_losses"], **TOL)
    assert hsdp["val_loss"] == pytest.approx(one["val_loss"], **TOL)
    assert hsdp["cross_node_all_reduces"] == hsdp["step"] * 3
