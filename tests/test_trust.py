"""Trust: what the tools guarantee when a file is hostile or corrupt, a scheduler or a peer ends a run,
and a setting is wrong (README "Reliability"). Each test is a case a prober found:
- a checkpoint that carries a pickled payload runs nothing through any load path, one line each;
- paths inside a checkpoint are not followed: a moved or crafted run folder resumes where it is told;
- a flipped byte in a checkpoint is refused, naming the tensor (ckpt.pt) or the file (ckpt.dcp/);
- SIGTERM ends a run like Ctrl-C; a lock of another host says how to take it over; a frozen or killed
  peer ends the others within the collective timeout with one line, at any collective; a failure or
  refusal on one rank ends every rank within seconds, each with the one line naming that rank;
- a new run never overwrites a run folder; a resume keeps its global batch;
- bad settings of every CLI: one line naming the setting, exit status 2, nothing accepted in silence.
"""
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile

import pytest
import torch

import eval_core
import fit
import grow
import ladder
import probe
import sample
import train
from conftest import REPO, one_line_error
from data import prepare as prep
from tooling import checkpoint, convert_checkpoint, core_bundle, guards, match_cli, memory, plots, rundir

SMALL = dict(n_layer=2, n_embd=32, n_head=2, n_expert=4, top_k=2, layout="smelt", n_passes=2, block_size=32,
             batch_size=4, eval_tokens=256, warmup_steps=2, eval_interval=2)


def argv(**settings):
    return [f"--{k}={v!r}" if not isinstance(v, str) else f"--{k}={v}" for k, v in settings.items()]


def subprocess_env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir):
    """A finished 4-step run: its folder (out/run), to be copied by each test."""
    out = tmp_path_factory.mktemp("trained")
    train.train(SMALL | dict(data_dir=data_dir, out_dir=str(out), run_name="run", max_steps=4))
    return out / "run"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, data_dir):
    """A finished 2-step FSDP run (one process, one shard): its folder, holding ckpt.dcp/."""
    out = tmp_path_factory.mktemp("sharded")
    result = subprocess.run([sys.executable, "train.py", *argv(**SMALL, data_dir=data_dir, out_dir=str(out),
                                                               run_name="run", max_steps=2, parallel="fsdp")],
                            cwd=REPO, capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.isdir(out / "run" / "ckpt.dcp")
    return out / "run"


def copy_run(run, tmp_path, name="run"):
    target = tmp_path / "out" / name
    shutil.copytree(run, target)
    return target


# ----------------------------------------------------------------------------------------------------
# 1. No load runs code


class Payload:
    """Unpickling this runs `touch marker`: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def evil_checkpoint(trained, path, marker):
    """The trained checkpoint with a payload beside its weights, saved the way torch.save allows."""
    ckpt = checkpoint.load_checkpoint(trained / "ckpt.pt")
    torch.save(dict(ckpt, payload=Payload(marker)), path)
    return path


def evil_sharded(sharded, tmp_path, marker, where):
    run = copy_run(sharded, tmp_path)
    meta_path = run / "ckpt.dcp" / checkpoint.SHARDED_META
    meta = torch.load(meta_path, weights_only=True)
    if where == "meta.pt":
        torch.save(dict(meta, payload=Payload(marker)), meta_path)
    else:  # DCP's own .metadata, with its checksum recorded as a crafted checkpoint would
        metadata = run / "ckpt.dcp" / ".metadata"
        metadata.write_bytes(__import__("pickle").dumps(Payload(marker)))
        meta["file_checksums"][".metadata"] = checkpoint.file_crc(metadata)
        torch.save(meta, meta_path)
    return run


LOAD_PATHS = ["sample", "probe", "grow", "eval_core", "train --init_from", "train --resume",
              "train --resume ckpt.dcp meta.pt", "train --resume ckpt.dcp .metadata"]


@pytest.mark.parametrize("path", LOAD_PATHS)
def test_a_malicious_checkpoint_runs_nothing_through_any_load_path(path, trained, sharded, data_dir, tmp_path,
                                                                   capsys):
    marker = tmp_path / "PWNED"
    evil = evil_checkpoint(trained, tmp_path / "evil.pt", marker)
    out = tmp_path / "out"
    runs = {
        "sample": (sample.main, ["--ckpt", str(evil)], "sample.py"),
        "probe": (probe.main, ["--ckpt", str(evil), "--data_dir", data_dir], "probe.py"),
        "grow": (grow.main, ["--ckpt", str(evil), "--out", str(tmp_path / "grown.pt")], "grow.py"),
        "eval_core": (eval_core.main, ["--ckpt", str(evil), "--length_buckets", data_dir], "eval_core.py"),
        "train --init_from": (train.main, argv(init_from=str(evil), out_dir=str(out), data_dir=data_dir), "train.py"),
    }
    if path == "train --resume":
        run = copy_run(trained, tmp_path)
        shutil.copy(evil, run / "ckpt.pt")
        runs[path] = (train.main, argv(init_from="resume", out_dir=str(out), run_name="run"), "train.py")
    elif path.startswith("train --resume ckpt.dcp"):
        evil_sharded(sharded, tmp_path, marker, path.split()[-1])
        runs[path] = (train.main, argv(init_from="resume", out_dir=str(out), run_name="run"), "train.py")
    main, args, prog = runs[path]
    err = one_line_error(main, args, capsys, prog)
    assert not marker.exists(), f"{path} ran the checkpoint's payload"
    assert "refuse" in err and "could run code" in err, err


def test_an_older_checkpoint_is_refused_and_converts_knowingly(trained, tmp_path, capsys):
    """A checkpoint of the first format (Python objects: a ModelConfig, numpy RNG state, the state at the
    top level) is refused with the command that converts it; converted, it loads and resumes."""
    import numpy as np
    ckpt = checkpoint.load_checkpoint(trained / "ckpt.pt")
    state = ckpt["state"]
    old = dict(model_config=train.ModelConfig(**ckpt["model_config"]), model=ckpt["model"],
               optimizer=ckpt["optimizer"], train_config=ckpt["train_config"],
               rng=dict(torch=ckpt["rng"]["torch"], numpy=np.random.get_state()),
               data_position={"region": state["data_region"], "windows": state["data_position"]},
               **{k: state[k] for k in convert_checkpoint.OLD_STATE})
    torch.save(old, tmp_path / "old.pt")
    err = one_line_error(sample.main, ["--ckpt", str(tmp_path / "old.pt")], capsys, "sample.py")
    assert f"python -m tooling.convert_checkpoint {tmp_path / 'old.pt'} NEW.pt" in err
    assert convert_checkpoint.main([str(tmp_path / "old.pt"), str(tmp_path / "new.pt")]) == 0
    model, new = checkpoint.load_model(tmp_path / "new.pt")
    assert new["state"]["step"] == state["step"] and new["state"]["data_position"] == state["data_position"]
    for name, tensor in ckpt["model"].items():
        assert torch.equal(model.state_dict()[name], tensor)


# ----------------------------------------------------------------------------------------------------
# 2. Paths inside a checkpoint are not followed


def test_a_moved_run_folder_resumes_where_it_is(trained, tmp_path, data_dir):
    moved = copy_run(trained, tmp_path / "moved")  # the checkpoint still says out_dir=<the old place>
    summary = train.train(dict(out_dir=str(moved.parent), run_name="run", init_from="resume", max_steps=6))
    assert summary["run_dir"] == str(moved) and summary["step"] == 6
    log = [json.loads(line) for line in open(moved / "log.jsonl")]
    assert [r["step"] for r in log] == [0, 2, 4, 6]
    assert len(open(trained / "log.jsonl").readlines()) == 3  # the original folder untouched


def test_a_crafted_checkpoint_writes_and_reads_only_where_the_command_says(trained, tmp_path, data_dir, capsys):
    run = copy_run(trained, tmp_path)
    ckpt = checkpoint.load_checkpoint(run / "ckpt.pt")
    elsewhere = tmp_path / "elsewhere"
    ckpt["train_config"].update(out_dir=str(elsewhere), run_name="pwn", data_dir=str(tmp_path / "nowhere"))
    checkpoint.save_file(run / "ckpt.pt", ckpt)
    base = dict(out_dir=str(run.parent), run_name="run", init_from="resume", max_steps=6)
    err = one_line_error(train.main, argv(**base), capsys, "train.py")
    assert f"data_dir={str(tmp_path / 'nowhere')!r}, which does not exist here" in err and "give --data_dir" in err
    summary = train.train(base | dict(data_dir=data_dir))
    assert summary["run_dir"] == str(run) and not elsewhere.exists()
    # a fork too: its folder is out_dir/run_name of the command (defaults included), never the source's
    fork = train.train(dict(init_from=str(run / "ckpt.pt"), out_dir=str(tmp_path / "forks"), data_dir=data_dir,
                            max_steps=8))
    assert fork["run_dir"] == str(tmp_path / "forks" / "tiny") and not elsewhere.exists()


def test_the_checkpoints_data_dir_is_used_only_if_it_exists_and_said(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path)
    train.train(dict(out_dir=str(run.parent), run_name="run", init_from="resume", max_steps=6))
    assert "data_dir from the checkpoint" in capsys.readouterr().out


def test_eval_core_reads_only_the_bundles_own_files(tmp_path):
    bundle = tmp_path / "bundle"
    (bundle / "eval_data").mkdir(parents=True)
    (tmp_path / "secret.jsonl").write_text('{"query": "x", "choices": ["a"], "gold": 0}\n')
    (bundle / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nt,25\n")
    for uri in ("../../secret.jsonl", str(tmp_path / "secret.jsonl")):
        (bundle / "core.yaml").write_text(f"icl_tasks:\n- label: t\n  dataset_uri: {uri}\n  num_fewshot: [0]\n"
                                          "  icl_task_type: multiple_choice\n")
        with pytest.raises(ValueError, match="outside the bundle's eval_data/: refused"):
            core_bundle.load_bundle(str(bundle))


# ----------------------------------------------------------------------------------------------------
# 3. Weights cannot rot unnoticed


def flip_a_byte(path, member_filter):
    """Flip one byte in the middle of the largest stored member of a zip (torch.save's format) that
    member_filter accepts; the members are stored uncompressed."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if member_filter(i.filename)), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        f.seek(info.header_offset + 30 + name_len + extra_len + info.file_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))


def test_a_flipped_byte_is_refused_naming_the_tensor(trained, tmp_path, data_dir, capsys):
    run = copy_run(trained, tmp_path)
    flip_a_byte(run / "ckpt.pt", lambda name: "/data/" in name)
    err = one_line_error(sample.main, ["--ckpt", str(run / "ckpt.pt")], capsys, "sample.py")
    assert "tensor " in err and "does not have the bytes it was written with" in err, err
    err = one_line_error(train.main, argv(out_dir=str(run.parent), run_name="run", init_from="resume"), capsys, "train.py")
    assert "does not have the bytes it was written with" in err
    # the converter does not launder it with fresh checksums, and has nothing to do on an intact current file
    err = one_line_error(convert_checkpoint.main, [str(run / "ckpt.pt"), str(tmp_path / "c.pt")], capsys,
                         "tooling.convert_checkpoint")
    assert "does not have the bytes it was written with" in err and not (tmp_path / "c.pt").exists()
    err = one_line_error(convert_checkpoint.main, [str(trained / "ckpt.pt"), str(tmp_path / "c.pt")], capsys,
                         "tooling.convert_checkpoint")
    assert "already in the current format" in err and not (tmp_path / "c.pt").exists()


def test_a_flipped_byte_in_a_shard_is_refused_naming_the_file(sharded, tmp_path, capsys):
    run = copy_run(sharded, tmp_path)
    shard = max((run / "ckpt.dcp").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    err = one_line_error(train.main, argv(out_dir=str(run.parent), run_name="run", init_from="resume"), capsys, "train.py")
    assert f"file {shard.name} does not have the bytes it was written with" in err


def test_a_truncated_meta_pt_is_one_line_naming_it(sharded, tmp_path, capsys):
    run = copy_run(sharded, tmp_path)
    meta = run / "ckpt.dcp" / checkpoint.SHARDED_META
    meta.write_bytes(meta.read_bytes()[:100])
    err = one_line_error(train.main, argv(out_dir=str(run.parent), run_name="run", init_from="resume"), capsys, "train.py")
    assert f"cannot read {meta}" in err


# ----------------------------------------------------------------------------------------------------
# 4. Under a scheduler: SIGTERM, locks, peers


def wait_for_log(log, lines, process, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(log) and len(open(log).readlines()) >= lines:
            return
        if process.poll() is not None:
            pytest.fail(f"the run ended early: {process.communicate()[1][-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"{log} did not reach {lines} lines within {timeout} s")


def test_sigterm_ends_a_run_like_ctrl_c(tmp_path, data_dir):
    run = tmp_path / "tiny"
    process = subprocess.Popen([sys.executable, "train.py", *argv(**SMALL, data_dir=data_dir, out_dir=str(tmp_path),
                                                                  max_steps=100000)],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=subprocess_env())
    wait_for_log(run / "log.jsonl", 2, process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("train.py: terminated (SIGTERM) at step "), err
    assert f"--out_dir={tmp_path} --run_name=tiny --init_from=resume" in err and "Traceback" not in err
    assert not (run / "lock").exists()
    step = checkpoint.load_checkpoint(run / "ckpt.pt")["state"]["step"]
    resumed = train.train(dict(out_dir=str(tmp_path), init_from="resume", max_steps=step + 2))
    assert resumed["step"] == step + 2


@pytest.mark.parametrize("signal_class, status, word", [(KeyboardInterrupt, 130, "interrupted"),
                                                         (rundir.Terminated, 143, "terminated")])
def test_ctrl_c_or_sigterm_before_training_is_one_line(tmp_path, data_dir, monkeypatch, capsys, signal_class,
                                                       status, word):
    """Ctrl-C or SIGTERM while the run is still loading or checking (before it holds its folder): one line."""
    def stopped(*args, **kwargs):
        raise signal_class()
    monkeypatch.setattr(train.memory, "check_memory", stopped)
    assert train.main(argv(**SMALL, data_dir=data_dir, out_dir=str(tmp_path), max_steps=2)) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"train.py: {word} before training began; nothing was written"]
    assert not (tmp_path / "tiny").exists()


def test_locks(tmp_path, data_dir, monkeypatch, capsys):
    run = tmp_path / "tiny"
    run.mkdir()
    settings = argv(**SMALL, data_dir=data_dir, out_dir=str(tmp_path), max_steps=2)
    (run / "lock").write_text("node-7 4242 2026-11-30T23:59:59")  # another host: cannot tell if it runs
    err = one_line_error(train.main, settings, capsys, "train.py")
    assert "locked by process 4242 on host node-7 since 2026-11-30T23:59:59" in err
    assert f"rm {run / 'lock'}" in err
    for stale in (f"{socket.gethostname()} 999999999 2026-11-30T23:59:59", ""):  # a dead process here; empty
        shutil.rmtree(run)
        run.mkdir()
        (run / "lock").write_text(stale)
        assert train.main(settings) == 0  # taken over
        assert not (run / "lock").exists()
    # a full disk while the lock is written: one line, and no empty lock left behind
    def disk_full(path, write):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(rundir, "write_atomic", disk_full)
    err = one_line_error(train.main, settings, capsys, "train.py")
    assert f"cannot write the lock file {run / 'lock'}: No space left on device" in err
    assert not (run / "lock").exists()


def start_two_processes(tmp_path, data_dir, extra=(), rank_extra=((), ()), fault=(), timeout_s=5.0, max_steps=100000):
    """Two train.py processes of one run (what torchrun would start); rank_extra: settings of one rank only;
    fault: (rank, point, kind) of tests/fault_driver.py, run in train.py's place."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = [os.path.join("tests", "fault_driver.py"), *map(str, fault)] if fault else ["train.py"]
    processes = []
    for rank in (0, 1):
        env = subprocess_env() | dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                                      LOOPSTUDY_COLLECTIVE_TIMEOUT_S=str(timeout_s))
        processes.append(subprocess.Popen(
            [sys.executable, *script, *argv(**SMALL, data_dir=data_dir, out_dir=str(tmp_path), max_steps=max_steps),
             *extra, *rank_extra[rank]],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    return processes


def ended_in_one_line(process, tmp_path, t0):
    """(the process's train.py line, seconds since t0) once it ended with status 2, one line, no traceback."""
    _, err = process.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.startswith("train.py:")]
    assert process.returncode == 2 and len(lines) == 1 and "Traceback" not in err, (process.returncode, err[-3000:])
    return lines[0], time.time() - t0


def assert_peer_line(line, tmp_path):
    assert "another process of the run died or stopped answering at step" in line, line
    assert "torchrun --nproc_per_node=2 train.py" in line and "--init_from=resume" in line, line
    assert not (tmp_path / "tiny" / "lock").exists()


@pytest.mark.parametrize("fault", ["frozen", "killed"])
def test_a_frozen_or_killed_peer_ends_the_run_within_the_timeout(fault, tmp_path, data_dir):
    first, second = start_two_processes(tmp_path, data_dir, ["--parallel=fsdp"])
    try:
        wait_for_log(tmp_path / "tiny" / "log.jsonl", 2, first)
        os.kill(second.pid, signal.SIGSTOP if fault == "frozen" else signal.SIGKILL)
        line, waited = ended_in_one_line(first, tmp_path, time.time())
    finally:
        second.kill()
        second.communicate()
    assert waited < 60, waited
    assert_peer_line(line, tmp_path)


@pytest.mark.parametrize("point", ["muon", "eval", "barrier", "dcp"])
def test_a_peer_frozen_at_any_collective_ends_the_run_in_one_line(point, tmp_path, data_dir):
    """Rank 1 stops itself (SIGSTOP) at one collective, once the first checkpoint is written: Muon's gathers
    under FSDP, the evaluation, a sharded save's barrier, DCP's own collectives. These were where rank 0
    ended with a traceback ("Application timeout caused pair closure", "could not write ...")."""
    first, second = start_two_processes(tmp_path, data_dir, ["--parallel=fsdp"], fault=(1, point, "freeze"),
                                        timeout_s=3.0)
    try:
        line, waited = ended_in_one_line(first, tmp_path, time.time())
    finally:
        second.kill()
        second.communicate()
    assert_peer_line(line, tmp_path)
    assert "(step 2)" in line  # the checkpoint the fault came after


def test_a_sharded_run_refuses_a_folder_its_ranks_do_not_share(tmp_path):
    """A rank that does not see rank 0's lock (out_dir on a disk of its own node) would write its shards
    elsewhere: refused, naming the lock; the same folder passes."""
    (tmp_path / "lock").write_text("node-0 42 2026-12-01T00:00:00")
    rundir.check_shared_folder(str(tmp_path), "node-0 42 2026-12-01T00:00:00", wait_s=0.1)
    with pytest.raises(ValueError, match=r"lock \(rank 0's lock\) is not there for this process: .* every node"):
        rundir.check_shared_folder(str(tmp_path), "node-0 43 2026-12-01T00:00:00", wait_s=0.1)


def other_data(tmp_path):
    """A data folder with another split of the same corpus: what a node with another copy of the data sees."""
    from conftest import small_corpus
    return prep.prepare([small_corpus(tmp_path)], str(tmp_path / "other"), val_fraction=0.3, seed=1, verbose=False)


RANK_FAILURES = {  # (fault, parallel, rank_extra, what every rank's line says)
    "data missing on rank 1": ((), "ddp", lambda tmp: ((), (f"--data_dir={tmp / 'absent'}",)),
                               "rank 1: {tmp}/absent/meta.json not found"),
    "data differs on rank 1": ((), "ddp", lambda tmp: ((), (f"--data_dir={other_data(tmp)}",)),
                               "the processes of the run differ in data, step: rank 0 has data="),
    "rank 1's disk full at a save": ((1, "write", "raise"), "fsdp", None,
                                     "rank 1: could not write checkpoint {tmp}/tiny/ckpt.dcp: the disk is full"),
    "rank 0's disk full at the log": ((0, "log", "raise"), "fsdp", None,
                                      "rank 0: could not write the log {tmp}/tiny/log.jsonl: No space left on device"),
    "rank 0 refuses the run folder": ((), "fsdp", None, "rank 0: {tmp}/tiny already holds a run (log.jsonl)"),
    "rank 1 has too little memory": ((1, "memory", "low"), "ddp", None, "is available on rank 1 (cpu); lower"),
}


@pytest.mark.parametrize("case", RANK_FAILURES)
def test_a_failure_on_one_rank_ends_every_rank_with_its_line(case, tmp_path, data_dir):
    """A refusal or failure on one rank only, with the default collective timeout (600 s): both ranks end
    within seconds, each with the one line naming the rank and the cause (or, for a decision made together,
    the same refusal); no temp files or lock are left."""
    fault, parallel, rank_extra, said = RANK_FAILURES[case]
    if case == "rank 0 refuses the run folder":
        (tmp_path / "tiny").mkdir()
        (tmp_path / "tiny" / "log.jsonl").write_text("{}\n")
    t0 = time.time()
    processes = start_two_processes(tmp_path, data_dir, [f"--parallel={parallel}"], fault=fault, timeout_s=600.0,
                                    max_steps=6, rank_extra=rank_extra(tmp_path) if rank_extra else ((), ()))
    try:
        ended = [ended_in_one_line(p, tmp_path, t0) for p in processes]
    finally:
        for p in processes:
            p.kill()
            p.communicate()
    for line, seconds in ended:
        assert said.format(tmp=tmp_path) in line and seconds < 30, (line, seconds)
    assert ended[0][0] == ended[1][0]  # the same line on every rank
    run = tmp_path / "tiny"
    if run.exists():
        assert not (run / "lock").exists() and not list(run.glob(".*")), sorted(p.name for p in run.iterdir())


# ----------------------------------------------------------------------------------------------------
# 5. Run folders and the global batch


def test_a_new_run_never_overwrites_a_run_folder(trained, tmp_path, data_dir, capsys):
    run = copy_run(trained, tmp_path)
    (run / "ckpt_step2.pt").write_bytes((run / "ckpt.pt").read_bytes())
    settings = argv(**SMALL, data_dir=data_dir, out_dir=str(run.parent), run_name="run", max_steps=2)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    err = one_line_error(train.main, settings, capsys, "train.py")
    assert "already holds a run (ckpt.pt, ckpt_step2.pt, log.jsonl)" in err
    assert "--init_from=resume" in err and "delete the folder" in err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    err = one_line_error(train.main, settings + ["--overwrite=True"], capsys, "train.py")
    assert "unknown command-line key 'overwrite': it went (delete the run folder" in err


def test_a_resume_keeps_the_global_batch_on_any_number_of_processes(trained, tmp_path):
    run = copy_run(trained, tmp_path)
    resume = dict(out_dir=str(run.parent), run_name="run", init_from="resume")
    values, source, _ = rundir.resolve_run(train.SETTINGS, resume)
    assert source["state"]["seqs_per_step"] == 4 and values["global_batch"] == 4
    config = train.SETTINGS.build(train.TrainConfig, values | dict(batch_size=2))
    guards.derive_grad_accum(config, 1, source)
    assert config.grad_accum == 2  # half the sequences per micro-batch: twice the accumulation
    values, _, _ = rundir.resolve_run(train.SETTINGS, resume | dict(batch_size=3))
    config = train.SETTINGS.build(train.TrainConfig, values)
    with pytest.raises(ValueError, match=r"global_batch=4 \(the sequences per step of the run it continues\) is "
                                         r"not a multiple of batch_size x processes = 3 x 1"):
        guards.derive_grad_accum(config, 1, source)


# ----------------------------------------------------------------------------------------------------
# 6. Failures that say what failed


def test_a_log_cut_short_resumes_and_a_bad_line_is_named(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path)
    log = run / "log.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines) + '{"step": 6, "val_lo')  # killed mid-write
    summary = train.train(dict(out_dir=str(run.parent), run_name="run", init_from="resume", max_steps=6))
    assert [json.loads(line)["step"] for line in open(log)] == [0, 2, 4, 6] and summary["step"] == 6
    lines = log.read_text().splitlines(keepends=True)
    log.write_text(lines[0] + '{"step": 2, "val_loss": 1.0,,}\n' + "".join(lines[2:]))  # hand-edited
    err = one_line_error(train.main, argv(out_dir=str(run.parent), run_name="run", init_from="resume", max_steps=8),
                         capsys, "train.py")
    assert f"{log}:2: malformed JSON" in err and "fix or delete that line" in err


def test_a_wrong_tokenizer_is_refused_before_training(tmp_path, data_dir, capsys):
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps(dict(meta, tokenizer="gpt2-8192")))
    err = one_line_error(train.main, argv(**SMALL, data_dir=str(data), out_dir=str(tmp_path), max_steps=2), capsys,
                         "train.py")
    assert "tokenizer gpt2-8192 has n_vocab=8192" in err and "meta.json" in err
    assert not (tmp_path / "tiny" / "log.jsonl").exists()


def test_a_full_disk_at_the_log_names_it_and_the_checkpoint_kept(tmp_path, data_dir, monkeypatch, capsys):
    real_open = open

    def open_full(path, mode="r", *args, **kwargs):
        if str(path).endswith("log.jsonl") and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)
    monkeypatch.setattr(rundir, "open", open_full, raising=False)
    err = one_line_error(train.main, argv(**SMALL, data_dir=data_dir, out_dir=str(tmp_path), max_steps=2), capsys,
                         "train.py")
    assert f"could not write the log {tmp_path / 'tiny' / 'log.jsonl'}: No space left on device" in err
    assert f"the last checkpoint is kept: {tmp_path / 'tiny' / 'ckpt.pt'} (step 2)" in err


def test_the_step_0_line_waits_for_the_first_checkpoint(tmp_path, data_dir, monkeypatch, capsys):
    def interrupted(config, step):
        if step == 1:
            raise KeyboardInterrupt
    monkeypatch.setattr(train, "passes_of_step", interrupted)
    settings = SMALL | dict(data_dir=data_dir, out_dir=str(tmp_path), max_steps=6, eval_interval=4)
    assert train.main(argv(**settings)) == 130
    assert "no checkpoint was written yet" in capsys.readouterr().err
    assert not (tmp_path / "tiny" / "log.jsonl").exists() and not (tmp_path / "tiny" / "ckpt.pt").exists()


def test_a_decay_branch_forks_only_a_stable_checkpoint(tmp_path, data_dir, capsys):
    decayed = train.train(SMALL | dict(data_dir=data_dir, out_dir=str(tmp_path), run_name="decayed", max_steps=6,
                                       decay_fraction=0.5))
    branch = dict(out_dir=str(tmp_path), data_dir=data_dir, decay_tokens=256)  # a fork with decay_tokens
    err = one_line_error(train.main, argv(**branch, init_from=decayed["ckpt_path"]), capsys, "train.py")
    assert "after its LR began to decay at step 3" in err
    stable = train.train(SMALL | dict(data_dir=data_dir, out_dir=str(tmp_path), run_name="stable", max_steps=4,
                                      decay_fraction=0.0))
    first = train.train(branch | dict(init_from=stable["ckpt_path"]))
    err = one_line_error(train.main, argv(**branch, init_from=first["ckpt_path"], run_name="again"), capsys,
                         "train.py")
    assert "is itself a decay branch (forked at step 4)" in err


# ----------------------------------------------------------------------------------------------------
# 7. No bad setting accepted in silence: every CLI, one line naming the setting


def _ckpt(trained):
    return str(trained / "ckpt.pt")


BAD_SETTINGS = [  # (prog, argv, what the line must name); CKPT / DATA are filled in
    ("train.py", ["--boundary_alpha=-1e999"], "boundary_alpha=-inf: must be a finite number"),
    ("train.py", ["--grad_clip=nan"], "grad_clip=nan: must be a finite number"),
    ("train.py", ["--matrix_lr=-1"], "matrix_lr=-1.0: must be >= 0"),
    ("train.py", ["--avg_doc_len=1000000000"], "avg_doc_len=1000000000"),
    ("train.py", ["--seed=-1"], "seed=-1: must be >= 0"),
    ("train.py", ["--run_name=a\nb"], "run_name="),
    ("train.py", ["--run_name=x\u202egpj.exe"], "run_name="),
    ("train.py", ["--run_name=bad\udcff"], "run_name="),
    ("train.py", ["--run_name=a b"], "run_name='a b'"),
    ("train.py", ["--out_dir=out\u200b"], "out_dir="),
    ("train.py", ["--layout=plain", "--n_passes=3"], "n_passes=3: does nothing in layout 'plain'"),
    ("train.py", ["--layout=pcc", "--n_passes=0"], "n_passes=0: must be >= 1"),
    ("train.py", ["--n_layer=1"], "loop_span"),
    ("train.py", ["--batch_size=0"], "batch_size=0: must be >= 1"),
    ("train.py", ["--eval_tokens=-5"], "eval_tokens=-5"),
    ("train.py", ["--branch_data_fraction=1.5"], "branch_data_fraction=1.5"),
    ("train.py", ["--adam_betas=(0.9, 1.2)"], "adam_betas"),
    ("train.py", ["--dtype=bf16"], "dtype='bf16'"),
    ("train.py", ["--max_step=10"], "unknown command-line key 'max_step'"),
    ("train.py", ["--n_embd=1.5"], "n_embd=1.5 has type float"),
    ("train.py", ["--save_steps=[0]"], "save_steps"),
    ("train.py", ["--n_passes_choices=[2]", "--layout=plain"], "n_passes_choices"),
    ("train.py", ["--decay_branch=True"], "unknown command-line key 'decay_branch': it went (init_from=<checkpoint>"),
    ("train.py", ["--eot_token=7"], "unknown command-line key 'eot_token': it went (a new run takes its data's"),
    ("train.py", ["--resume=True"], "unknown command-line key 'resume': it went (init_from=resume"),
    ("sample.py", ["--ckp", "CKPT"], "unrecognized arguments: --ckp"),
    ("sample.py", ["--top_k", "0"], "argument --top_k: 0: must be >= 1"),
    ("sample.py", ["--temperature", "nan"], "argument --temperature: nan: must be a finite number"),
    ("sample.py", ["--num_samples", "0"], "argument --num_samples: 0: must be >= 1"),
    ("sample.py", ["--seed", "-1"], "argument --seed: -1: must be >= 0"),
    ("sample.py", ["--ckpt", "CKPT", "--n_passes", "0"], "argument --n_passes: 0: must be >= 1"),
    ("probe.py", ["--ckpt", "CKPT", "--tokens", "0"], "argument --tokens: 0: must be >= 1"),
    ("probe.py", ["--ckpt", "CKPT", "--kl_threshold", "-1"], "argument --kl_threshold: -1: must be > 0"),
    ("probe.py", ["--ckpt", "CKPT", "--visits", "0", "2"], "argument --visits: 0: must be >= 1"),
    ("probe.py", ["--ckpt", "CKPT", "--tok", "5"], "unrecognized arguments: --tok"),
    ("grow.py", ["--ckpt", "CKPT", "--passes", "0"], "argument --passes: 0: must be >= 1"),
    ("grow.py", ["--schedule", "config/smelt_200m_base.py"], "layout 'plain': the growth schedule is [X]'s"),
    ("grow.py", ["--schedule", "config/x_d8_loop2.py", "--passes", "2"], "--passes 2: growth goes to more than"),
    ("grow.py", ["--ckpt", "CKPT", "--out", "DIR"], "is a directory; give the checkpoint file to write"),
    ("eval_core.py", ["--ckpt", "CKPT", "--batch_tokens", "0"], "argument --batch_tokens: 0: must be >= 1"),
    ("eval_core.py", ["--ckpt", "CKPT", "--max_per_task", "-2"], "argument --max_per_task: -2: must be >= -1"),
    ("eval_core.py", ["--ckpt", "CKPT", "--length_max_tokens", "0"], "argument --length_max_tokens: 0"),
    ("ladder.py", ["--preset", "smelt-micro", "--workers", "0"], "argument --workers: 0: must be >= 1"),
    ("ladder.py", ["--preset", "smelt-micro", "--bootstrap", "-5"], "argument --bootstrap: -5: must be >= 0"),
    ("ladder.py", ["--preset", "smelt-micro", "--boot", "5"], "unrecognized arguments: --boot"),
    ("ladder.py", ["--plan", "config/x_d8_vanilla.py", "--gpus", "0"], "argument --gpus: 0: must be >= 1"),
    ("fit.py power", ["power", "FINEWEB", "--ref", "Vanilla", "--C0", "nan"], "argument --C0: nan: must be a finite"),
    ("fit.py power", ["power", "FINEWEB", "--re", "Vanilla"], "the following arguments are required: --ref"),
    ("match.py", ["--preset", "smelt-200m-s95", "--attended", "-3"], "argument --attended: -3: must be > 0"),
    ("match.py", ["--preset", "smelt-200m-s95", "--rec", "smelt"], "unrecognized arguments: --rec"),
    ("grow.py", ["--schedule", "TYPO"], "unknown settings ['n_layr']"),
    ("tooling.plots", ["LOG", "--x", "time"], "argument --x: invalid choice"),
    ("tooling.plots", ["LOG", "--ou", "x.png"], "unrecognized arguments: --ou"),
    ("train.py", ["--seed=1e30"], "seed=1000000000000000019884624838656: must be below 2**53"),
    ("train.py", ["--max_steps=1e30"], "max_steps=1000000000000000019884624838656: must be below 2**53"),
    ("train.py", ["--out_dir="], "out_dir='': must name a folder"),
    ("sample.py", ["--ckpt", "CKPT", "--seed", "18446744073709551616"], "argument --seed: 18446744073709551616"),
    ("probe.py", ["--ckpt", "CKPT", "--device", "tpu"], "unknown device 'tpu'"),
    ("probe.py", ["--ckpt", "CKPT", "--plot", "TYPO"], "File exists"),
    ("tooling.memory", ["config/x_d8_loop2.py", "--gpu_gb", "nan"], "argument --gpu_gb: nan: must be a finite"),
    ("tooling.memory", ["config/x_d8_loop2.py", "--world_size", "0"], "argument --world_size: 0: must be >= 1"),
    ("prepare.py", ["--seed", "-1", "--out", "DIR"], "--seed must be >= 0, got -1"),
    ("prepare.py", ["--workers", "100000", "--out", "DIR"], "--workers must be at most 4 x the"),
]
MAINS = {"train.py": train.main, "sample.py": sample.main, "probe.py": probe.main, "grow.py": grow.main,
         "eval_core.py": eval_core.main, "tooling.plots": plots.main, "ladder.py": ladder.main, "fit.py power": fit.main,
         "match.py": match_cli.main, "tooling.memory": memory.main, "prepare.py": prep.main}


@pytest.mark.parametrize("prog, args, named", BAD_SETTINGS, ids=[f"{p} {' '.join(a)}" for p, a, _ in BAD_SETTINGS])
def test_every_bad_setting_is_one_line_naming_it(prog, args, named, trained, data_dir, tmp_path, capsys):
    typo = tmp_path / "typo.py"
    typo.write_text('layout = "pcc"\nn_layr = 8\n')
    fill = {"CKPT": _ckpt(trained), "DATA": data_dir, "DIR": str(tmp_path), "LOG": str(trained / "log.jsonl"),
            "FINEWEB": os.path.join(REPO, "tests", "data", "fineweb_ladders.csv"), "TYPO": str(typo)}
    args = [fill.get(a, a) for a in args]
    if prog == "train.py":  # never reaches training: nothing is written
        args = [f"--out_dir={tmp_path / 'never'}", f"--data_dir={data_dir}"] + args
    err = one_line_error(MAINS[prog], args, capsys, prog)
    assert named in err, err
    assert not (tmp_path / "never").exists()


def test_the_catalogue_covers_40_bad_settings_across_the_clis():
    assert len(BAD_SETTINGS) >= 40 and len({prog for prog, _, _ in BAD_SETTINGS}) >= 9


@pytest.mark.parametrize("text", ["0", "abc", "nan", "-5"])
def test_a_bad_collective_timeout_is_one_line_naming_it(text, monkeypatch, tmp_path, capsys):
    """The collective timeout is the environment's (LOOPSTUDY_COLLECTIVE_TIMEOUT_S, 600 s when unset): a value
    that is no number of seconds >= 1 ends a run before it starts, in one line naming the variable."""
    from tooling import distributed
    monkeypatch.delenv(distributed.COLLECTIVE_TIMEOUT_ENV, raising=False)
    assert distributed.collective_timeout_s() == 600.0
    monkeypatch.setenv(distributed.COLLECTIVE_TIMEOUT_ENV, "7.5")
    assert distributed.collective_timeout_s() == 7.5
    monkeypatch.setenv(distributed.COLLECTIVE_TIMEOUT_ENV, text)
    err = one_line_error(train.main, [f"--out_dir={tmp_path / 'never'}", "--max_steps=1"], capsys, "train.py")
    assert f"LOOPSTUDY_COLLECTIVE_TIMEOUT_S='{text}': must be a number of seconds >= 1" in err
    assert not (tmp_path / "never").exists()
