"""Every parallel combination train.py allows, run: layout x parallel (ddp, fsdp) x {a plain step, growth tied,
growth untied, random passes, an untied model drawing fewer passes than its cores} x grad_accum {1, 2}, three
steps each under torchrun on 2 CPU processes (gloo), against one process with the same global batch (twice the
accumulation); some also with --compile, activation checkpointing or FSDP without resharding. --compile composes
with both wrappers (DDP inside torch.compile, FSDP2 sharded in place): the driver compiles with the aot_eager
backend (the graph decisions are the compiler's front end; inductor's C++ code generation would add minutes).
One torchrun launch runs every job (tests/fsdp_driver.py)."""
import json

import pytest

import train

BASE = dict(n_layer=2, n_embd=32, n_head=2, block_size=32, batch_size=2, eval_tokens=128, warmup_steps=1,
            eval_interval=3, max_steps=3, log_interval=1)
MOE = dict(n_expert=4, top_k=2, expert_hidden=16)
PCC = dict(layout="pcc", n_layer=3, boundary="both", boundary_alpha=0.7)
CASES = {  # the optimizers alternate so both (and the [X] Muon's sharded variance reduction) run in parallel
    "plain_moe": dict(MOE, layout="plain", optimizer="muon_x"),
    "smelt_moe_grow": dict(MOE, layout="smelt", n_passes=1, grow_at=2.0, grow_to=2, optimizer="muon"),
    "smelt_moe_random": dict(MOE, layout="smelt", n_passes=2, n_passes_choices=[1, 2, 3], optimizer="adamw"),
    "layer_loop_random": dict(layout="layer_loop", n_passes=2, n_passes_choices=[1, 2], optimizer="muon_x"),
    "pcc_grow_tied": dict(PCC, n_passes=1, grow_at=2.0, grow_to=2, optimizer="muon"),
    "pcc_grow_untied": dict(PCC, n_passes=1, grow_at=2.0, grow_to=2, grow_untie=True, optimizer="adamw"),
    "pcc_tied_random": dict(PCC, n_passes=2, n_passes_choices=[1, 2, 3], optimizer="muon_x"),
    "pcc_untied_random_below_k": dict(PCC, n_passes=3, tie_core=False, n_passes_choices=[1, 2], optimizer="muon"),
}
OPTIONS = {  # more runs of some cases at grad_accum 2, under both wrappers: settings that change the step
    "pcc_tied_random": {"compiled": dict(compile=True)},
    "smelt_moe_random": {"compiled": dict(compile=True)},
    "pcc_grow_untied": {"compiled": dict(compile=True), "checkpointed": dict(activation_checkpointing=True)},
    "smelt_moe_grow": {"checkpointed": dict(activation_checkpointing=True)},
    "pcc_untied_random_below_k": {"unsharded": dict(parallel="fsdp_grad_op")},  # gathered forward to backward
}
FSDP_ONLY = {"unsharded"}
TOL = dict(rel=1e-5, abs=1e-6)  # fp32: gradient sums in another order, the same Newton-Schulz inputs


def variants(case, grad_accum, parallel):
    """(name suffix, overrides) of the runs of a case at an accumulation: the plain one, then its options."""
    options = [(k, v) for k, v in OPTIONS.get(case, {}).items() if parallel == "fsdp" or k not in FSDP_ONLY]
    return [("", {})] + (options if grad_accum == 2 else [])


def job_name(case, parallel, grad_accum, option=""):
    return f"{case}-{parallel}-ga{grad_accum}" + (f"-{option}" if option else "")


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory, data_dir, torchrun):
    """Every job, run once by 2 torchrun processes; returns {job name: its summary}."""
    root = tmp_path_factory.mktemp("parallel")
    jobs = []
    for case, settings in CASES.items():
        for parallel in ("ddp", "fsdp"):
            for grad_accum in (1, 2):
                for option, overrides in variants(case, grad_accum, parallel):
                    name = job_name(case, parallel, grad_accum, option)
                    jobs.append(dict(name=name, settings=BASE | settings | dict(
                        parallel=parallel, global_batch=2 * BASE["batch_size"] * grad_accum, data_dir=data_dir,
                        out_dir=str(root / name)) | overrides))
    (root / "jobs.json").write_text(json.dumps(jobs))
    torchrun(["tests/fsdp_driver.py", str(root / "jobs.json"), str(root / "results.json"), "--compile_backend",
              "aot_eager"], nproc=2, timeout=600)
    return {name: result["summaries"][0] for name, result in json.loads((root / "results.json").read_text()).items()}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data_dir):
    """The reference of each (case, accumulation of the 2-process job): one process, twice the micro-batches."""
    root = tmp_path_factory.mktemp("one")
    return {(case, grad_accum): train.train(BASE | settings | dict(
                global_batch=2 * BASE["batch_size"] * grad_accum, data_dir=data_dir,
                out_dir=str(root / f"{case}-{grad_accum}")))
            for case, settings in CASES.items() for grad_accum in (1, 2)}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_two_processes_train_what_one_process_trains(parallel_runs, one_process, case, parallel, grad_accum):
    one = one_process[case, grad_accum]
    for option, _ in variants(case, grad_accum, parallel):
        two = parallel_runs[job_name(case, parallel, grad_accum, option)]
        assert two["step"] == one["step"] == 3 and two["tokens"] == one["tokens"]  # the same global batch
        assert two["train_losses"] == pytest.approx(one["train_losses"], **TOL), (case, option)
        assert two["val_loss"] == pytest.approx(one["val_loss"], **TOL), (case, option)


def test_the_matrix_draws_fewer_passes_than_cores_and_grows():
    """The cases do what their names say: a run whose drawn passes leave cores unused, and growth mid-run."""
    from tooling.distributed import leaves_blocks_unused
    cfg = train.SETTINGS.build(train.ModelConfig, train.DEFAULTS | BASE | CASES["pcc_untied_random_below_k"])
    assert leaves_blocks_unused(cfg, [1, 2]) and not leaves_blocks_unused(cfg, [3])
    tied = train.SETTINGS.build(train.ModelConfig, train.DEFAULTS | BASE | CASES["pcc_tied_random"])
    assert not leaves_blocks_unused(tied, [1, 2, 3])
    assert all(1 <= CASES[c]["grow_at"] < BASE["max_steps"] for c in CASES if "grow_at" in CASES[c])
