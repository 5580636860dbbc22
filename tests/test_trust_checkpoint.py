"""Trust of the load path (issue 34), each a case a prober found, through every tool that loads a checkpoint
(sample, probe, grow, eval_core, train --init_from / --resume), each refusal one line:
- no load of a ckpt.dcp/ runs code: a "bytes" entry in its .metadata (DCP would unpickle it) is refused;
- no path inside a checkpoint is followed: meta.pt's file names and .metadata's storage paths stay inside;
- every byte is checked: any flipped bit of a ckpt.pt or meta.pt (a learning rate, not only a tensor);
- a checkpoint must fit its own config before anything is built: a claimed size, a dtype, NaN weights;
- a file that is not a checkpoint says so (never torch's advice to load with weights_only=False), and a
  failed write says a previous checkpoint is kept only when there is one.
"""
import contextlib
import errno
import io
import os
import pickle
import resource
import shutil
import struct
import subprocess
import sys
import zipfile
from types import SimpleNamespace

import pytest
import torch

import eval_core
import grow
import probe
import sample
import train
from conftest import REPO, one_line_error, within
from model import GPT, ModelConfig
from test_trust import Payload, argv, copy_run, sharded, trained  # noqa: F401 (fixtures)
from tooling import checkpoint, convert_checkpoint

META = checkpoint.SHARDED_META


@contextlib.contextmanager
def memory_cap(gib=8):
    """Allocations beyond `gib` GiB more than now fail at once: a tool that built a claimed model for real
    fails the test, not the host."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    used = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = used + (gib << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def load_path(name, ckpt, tmp_path, data_dir):
    """(main, argv, prog) of one tool loading the checkpoint `ckpt` (train --resume: as its run's ckpt.pt)."""
    out = tmp_path / "out"
    if name == "train --resume":
        (out / "run").mkdir(parents=True, exist_ok=True)
        if ckpt != out / "run" / "ckpt.pt":
            shutil.copy(ckpt, out / "run" / "ckpt.pt")
        return train.main, argv(init_from="resume", out_dir=str(out), run_name="run"), "train.py"
    (tmp_path / "grown").mkdir(exist_ok=True)
    return {
        "sample": (sample.main, ["--ckpt", str(ckpt)], "sample.py"),
        "probe": (probe.main, ["--ckpt", str(ckpt), "--data_dir", data_dir], "probe.py"),
        "grow": (grow.main, ["--ckpt", str(ckpt), "--out", str(tmp_path / "grown" / "g.pt")], "grow.py"),
        "eval_core": (eval_core.main, ["--ckpt", str(ckpt), "--length_buckets", data_dir], "eval_core.py"),
        "train --init_from": (train.main, argv(init_from=str(ckpt), out_dir=str(out), data_dir=data_dir), "train.py"),
    }[name]


LOAD_PATHS = ["sample", "probe", "grow", "eval_core", "train --init_from", "train --resume"]


# ----------------------------------------------------------------------------------------------------
# ckpt.dcp/: crafted as an attacker would, every checksum recomputed and meta.pt sealed again


def craft_dcp(run, metadata=None, checksums=None):
    """run's ckpt.dcp/ with .metadata edited (metadata(md, folder)), every file's CRC-32 recomputed,
    meta.pt's list edited (checksums(dict, folder)) and sealed: only the checks of meaning are left."""
    folder = run / "ckpt.dcp"
    if metadata:
        md = pickle.loads((folder / ".metadata").read_bytes())  # our own file: read as DCP does
        metadata(md, folder)
        (folder / ".metadata").write_bytes(pickle.dumps(md))
    meta = torch.load(folder / META, weights_only=True)
    meta["file_checksums"] = {f.name: checkpoint.file_crc(f) for f in folder.iterdir()
                              if f.name != META and f.is_file() and not f.is_symlink()}
    if checksums:
        checksums(meta["file_checksums"], folder)
    checkpoint.write_sharded_meta(str(folder), meta)
    return folder


def bytes_entry(marker, name="model.wte.weight"):
    """.metadata's `name` as a DCP "bytes" entry read from payload.bin: DCP's load_bytes unpickles it with
    torch.load(weights_only=False)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    def edit(md, folder):
        payload = io.BytesIO()
        torch.save(Payload(marker), payload)
        (folder / "payload.bin").write_bytes(payload.getvalue())
        md.state_dict_metadata[name] = BytesStorageMetadata()
        for index in [i for i in md.storage_data if i.fqn == name]:
            del md.storage_data[index]
        md.storage_data[MetadataIndex(name)] = _StorageInfo("payload.bin", 0, len(payload.getvalue()))
    return edit


@pytest.mark.parametrize("how", ["train --resume", "train --init_from"])
def test_a_bytes_entry_in_a_sharded_checkpoint_runs_nothing(how, sharded, data_dir, tmp_path, capsys):
    marker = tmp_path / "PWNED"
    run = copy_run(sharded, tmp_path)
    folder = craft_dcp(run, metadata=bytes_entry(marker))
    args = argv(init_from="resume", out_dir=str(run.parent), run_name="run") if how == "train --resume" \
        else argv(init_from=str(folder), out_dir=str(tmp_path / "fork"), data_dir=data_dir)
    err = one_line_error(train.main, args, capsys, "train.py")
    assert not marker.exists(), f"{how} ran the payload"
    assert f"{folder}/.metadata: model.wte.weight is stored as BytesStorageMetadata, not as a tensor: refused, " \
           "loading it could run code" in err, err
    # DCP's own reader and planner, as load_sharded_tensors uses them, refuse it too (past the checks before)
    reader, planner = checkpoint.dcp_reader(str(folder), {f.name: f.stat().st_size for f in folder.iterdir()})
    with pytest.raises(ValueError, match="not as a tensor: refused"):
        reader.read_metadata()
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="model.wte.weight"))
    with pytest.raises(ValueError, match="stored as pickled bytes: refused"):
        planner.load_bytes(item, io.BytesIO((folder / "payload.bin").read_bytes()))
    assert not marker.exists()


def elsewhere(how):
    """A .metadata edit: every tensor read from another run's shard (an absolute path, or through ..)."""
    def edit(md, folder):
        other = folder.parent.parent / "other" / "ckpt.dcp"
        for info in md.storage_data.values():
            target = other / info.relative_path
            info.relative_path = str(target) if how == "absolute" else os.path.relpath(target, folder)
    return edit


def unlisted(md, folder):
    shutil.copy(folder / "__0_0.distcp", folder / "extra.distcp")
    for info in md.storage_data.values():
        info.relative_path = "extra.distcp"


def link(name, target):
    def edit(checksums, folder):
        os.symlink(target, folder / name)
        checksums[name] = 0
    return edit


PATH_CRAFTS = {  # name: (craft_dcp arguments, what the one line says)
    "meta.pt lists /dev/zero": (dict(checksums=lambda c, f: c.update({"/dev/zero": 0})),
                                f"{META} lists '/dev/zero', not a file name inside the checkpoint"),
    "meta.pt lists ../ckpt.pt": (dict(checksums=lambda c, f: c.update({"../ckpt.pt": checkpoint.file_crc(
        f.parent / "ckpt.pt")})), f"{META} lists '../ckpt.pt', not a file name inside the checkpoint"),
    "meta.pt lists a link to /dev/zero": (dict(checksums=link("zero", "/dev/zero")), "zero is not a regular file"),
    "meta.pt lists a link out": (dict(checksums=link("out", "../ckpt.pt")), "out is not a regular file"),
    "tensors stored at an absolute path": (dict(metadata=elsewhere("absolute")), "is stored in '/"),
    "tensors stored through ..": (dict(metadata=elsewhere("..")), "is stored in '../../other/ckpt.dcp/"),
    "tensors stored in an unlisted file": (dict(metadata=unlisted, checksums=lambda c, f: c.pop("extra.distcp")),
                                           "is stored in 'extra.distcp', not in a file of the checkpoint that "
                                           f"{META} lists"),
}


@pytest.mark.parametrize("case", PATH_CRAFTS)
def test_no_path_inside_a_sharded_checkpoint_is_followed(case, sharded, tmp_path, capsys):
    run = copy_run(sharded, tmp_path)
    shutil.copytree(sharded, tmp_path / "out" / "other")  # what the crafted paths point at
    craft, said = PATH_CRAFTS[case]
    craft_dcp(run, **craft)
    with within(60):
        err = one_line_error(train.main, argv(init_from="resume", out_dir=str(run.parent), run_name="run"), capsys, "train.py")
    assert said in err and "paths inside a checkpoint are never followed" in err, err


def test_a_sharded_checkpoint_that_claims_another_model_or_holds_nan_is_refused(sharded, tmp_path, capsys):
    """Its shapes (from .metadata) against its config before anything is built; NaN weights after DCP reads
    them, on every rank alike."""
    run = copy_run(sharded, tmp_path)
    folder = run / "ckpt.dcp"
    resume = argv(init_from="resume", out_dir=str(run.parent), run_name="run")
    meta = torch.load(folder / META, weights_only=True)
    checkpoint.write_sharded_meta(str(folder), dict(meta, model_config=dict(meta["model_config"], n_embd=16384)))
    with memory_cap():
        err = one_line_error(train.main, resume, capsys, "train.py")
    assert "wte.weight is stored with shape [4096, 32], the config's model has [4096, 16384]" in err, err
    checkpoint.write_sharded_meta(str(folder), meta)
    # one weight's first value made NaN inside its shard, the CRC-32s recomputed
    md, _ = checkpoint.read_dcp_metadata(str(folder), checkpoint.listed_files(str(folder), meta["file_checksums"]))
    info = next(i for index, i in md.storage_data.items() if index.fqn == "model.norm_f.weight")
    shard = bytearray((folder / info.relative_path).read_bytes())
    piece = bytes(shard[info.offset:info.offset + info.length])
    values = torch.load(io.BytesIO(piece), weights_only=True).numpy().tobytes()
    at = info.offset + piece.index(values)
    shard[at:at + 4] = struct.pack("<f", float("nan"))
    (folder / info.relative_path).write_bytes(bytes(shard))
    craft_dcp(run)
    err = one_line_error(train.main, resume, capsys, "train.py")
    assert f"{folder}: weight norm_f.weight holds NaN or inf" in err, err


# ----------------------------------------------------------------------------------------------------
# Every byte checked


def flip(path, position, bit):
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ (1 << bit)]))


def small_checkpoint(path):
    """A train.py checkpoint of a tiny model, one optimizer step in (AdamW and Muon state)."""
    model = GPT(ModelConfig(vocab_size=64, eot_token=63, block_size=16, n_layer=2, n_embd=16, n_head=2, n_expert=2,
                            top_k=1, layout="smelt", n_passes=2))
    config = train.TrainConfig()
    optimizers = train.build_optimizers(model, config, ns_dtype=torch.float32)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for opt in optimizers:
        opt.step()
    checkpoint.save_file(path, checkpoint.training_checkpoint(model, optimizers, config, train.TrainState(step=1)))
    return path


def test_every_flipped_bit_of_a_checkpoint_is_refused(tmp_path):
    """A deterministic sample of bit positions across a whole ckpt.pt (every zip structure, the pickle of
    the settings and state, the tensors, the seal): each flip refused in one line, none loaded."""
    path = small_checkpoint(tmp_path / "ckpt.pt")
    size = path.stat().st_size
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        pickle_end = next(i for i in infos if i.filename.endswith("data.pkl"))
        pickle_end = pickle_end.header_offset + 100 + pickle_end.file_size
        tail = min(i.header_offset for i in infos if i.filename.endswith("/version"))  # small records, directory
    positions = sorted({*range(0, pickle_end, 53), *range(pickle_end, tail, tail // 30), *range(tail, size, 29)})
    said = {}
    for n, position in enumerate(positions):
        flip(path, position, n % 8)
        with pytest.raises(ValueError) as refused:
            checkpoint.load_checkpoint(path)
        flip(path, position, n % 8)
        message = str(refused.value)
        assert "\n" not in message and str(path) in message, (position, message)
        said[message.split(" (")[0].split(": tensor")[0]] = position
    assert len(positions) > 400
    assert set(said) <= {f"{path} does not have the bytes it was written with", str(path),
                         f"cannot read checkpoint {path}: it is not a loopstudy checkpoint",
                         f"{path} lacks the SHA-256 seal its format ends with"}, said
    checkpoint.load_checkpoint(path)  # every flip undone: intact


def test_every_flipped_bit_of_a_sharded_checkpoints_meta_and_metadata_is_refused(sharded, tmp_path):
    """meta.pt (sealed: its list of files and their CRC-32s) and .metadata (listed there), bit by bit."""
    folder = copy_run(sharded, tmp_path) / "ckpt.dcp"
    for name, step in ((META, 53), (".metadata", 997)):
        for n, position in enumerate(range(0, (folder / name).stat().st_size, step)):
            flip(folder / name, position, n % 8)
            with pytest.raises(ValueError) as refused:
                checkpoint.load_sharded_meta(str(folder))
            flip(folder / name, position, n % 8)
            message = str(refused.value)
            assert "\n" not in message and str(folder) in message, (name, position, message)
            if name == ".metadata":
                assert "file .metadata does not have the bytes it was written with" in message, message
    checkpoint.load_sharded_meta(str(folder))


def flip_the_learning_rate(src, dst):
    """dst: src with one exponent bit of train_config.matrix_lr flipped inside the pickle (torch does not
    check its zip entries' CRCs: before the seal this loaded, with another learning rate)."""
    ckpt = torch.load(src, weights_only=True)
    lr = ckpt["train_config"]["matrix_lr"]
    data = bytearray(open(src, "rb").read())
    at = data.index(b"matrix_lr")
    at = data.index(b"G" + struct.pack(">d", lr), at) + 1  # pickle's BINFLOAT: 8 bytes, big-endian
    data[at] ^= 0x20
    open(dst, "wb").write(bytes(data))
    changed = torch.load(dst, weights_only=True)["train_config"]["matrix_lr"]
    assert changed != lr and abs(changed) < 1e-10, changed
    return dst


# ----------------------------------------------------------------------------------------------------
# Each refusal through every load path


def crafted(name, trained, tmp_path, monkeypatch):
    """The trained ckpt.pt changed as `name` says, sealed again (a crafter's checkpoint) unless the seal is
    what is tested; -> (its path, what the one line says)."""
    source = trained / "ckpt.pt"
    path = tmp_path / "in" / "ckpt.pt"
    path.parent.mkdir()
    ckpt = checkpoint.load_checkpoint(source)
    config, weights = ckpt["model_config"], ckpt["model"]
    if name == "not a checkpoint":
        shutil.copy(trained / "log.jsonl", path)
        return path, "it is not a loopstudy checkpoint (not a zip file as torch.save writes them)"
    if name == "a flipped bit in the learning rate":
        return flip_the_learning_rate(source, path), "does not have the bytes it was written with (its SHA-256"
    if name == "format 2":
        torch.save(dict(ckpt, format=checkpoint.FORMAT_2), path)
        return path, "older format; convert it: python -m tooling.convert_checkpoint "
    said = "the weights do not match the model config stored with them: "
    if name == "claims n_embd=16384":
        config["n_embd"] = 16384
        said += "wte.weight is stored with shape [4096, 32], the config's model has [4096, 16384]"
    elif name == "claims n_embd=16384, n_layer=48":
        config.update(n_embd=16384, n_layer=48)
        said += "the config has 48 blocks, the weights 2 (blocks.2.* is missing)"
    elif name == "claims block_size=2**31":
        config["block_size"] = 2 ** 31
        said += "block_size=2147483648 needs 128 GiB of RoPE tables beside"
    elif name == "int64 weights":
        weights["norm_f.weight"] = weights["norm_f.weight"].long()
        said += "norm_f.weight is stored as torch.int64, the model's weights are torch.float32"
    elif name == "NaN weights":
        weights["blocks.1.attn.o_proj.weight"][0, 0] = float("nan")
        said = "weight blocks.1.attn.o_proj.weight holds NaN or inf (training never writes such weights)"
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "check_finite", lambda *args, **kwargs: None)  # a crafter's own save
        checkpoint.save_file(path, ckpt)
    return path, said


CASES = ["claims n_embd=16384", "claims n_embd=16384, n_layer=48", "claims block_size=2**31", "int64 weights",
         "NaN weights", "not a checkpoint", "a flipped bit in the learning rate", "format 2"]


@pytest.mark.parametrize("case", CASES)
def test_each_refusal_is_one_line_through_every_load_path(case, trained, data_dir, tmp_path, monkeypatch, capsys):
    ckpt, said = crafted(case, trained, tmp_path, monkeypatch)
    for path in LOAD_PATHS:
        main, args, prog = load_path(path, ckpt, tmp_path, data_dir)
        with memory_cap():
            err = one_line_error(main, args, capsys, prog)
        assert said in err and "weights_only" not in err, (path, err)


def test_a_device_or_a_fifo_given_as_the_checkpoint_is_refused(tmp_path, capsys):
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)  # opening it would wait for a writer
    for path in ("/dev/zero", str(fifo)):
        with within(30):
            err = one_line_error(sample.main, ["--ckpt", path], capsys, "sample.py")
        assert f"cannot read checkpoint {path}: it is not a regular file" in err, err


def test_a_format_2_checkpoint_converts_the_safe_way(trained, sharded, tmp_path, monkeypatch, capsys):
    """Format 2 (plain data, unsealed) is refused with the command that converts it; the converter reads it
    with weights_only=True, checks its tensors' CRC-32s and seals it; a ckpt.dcp/ converts in place."""
    old = tmp_path / "old.pt"
    ckpt = torch.load(trained / "ckpt.pt", weights_only=True)
    torch.save(dict(ckpt, format=checkpoint.FORMAT_2), old)
    unsafe = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: unsafe.append(k) or real_load(*a, **k))
    assert convert_checkpoint.main([str(old), str(tmp_path / "new.pt")]) == 0
    assert all(k.get("weights_only") for k in unsafe), unsafe  # never unpickled the unsafe way
    model, new = checkpoint.load_model(tmp_path / "new.pt")
    assert new["format"] == checkpoint.FORMAT and new["state"] == ckpt["state"]
    assert new["train_config"] == ckpt["train_config"]
    # a corrupt format-2 file is not sealed with fresh checksums
    data = bytearray(old.read_bytes())
    with zipfile.ZipFile(old) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    data[info.header_offset + 200] ^= 0x40
    old.write_bytes(bytes(data))
    err = one_line_error(convert_checkpoint.main, [str(old), str(tmp_path / "c.pt")], capsys,
                         "tooling.convert_checkpoint")
    assert "does not have the bytes it was written with" in err and not (tmp_path / "c.pt").exists()
    # a ckpt.dcp/ of format 2: refused at resume with the command, converted in place, resumed
    run = copy_run(sharded, tmp_path)
    folder = run / "ckpt.dcp"
    meta = real_load(folder / META, weights_only=True)
    real_save = torch.save
    real_save(dict(meta, format=checkpoint.FORMAT_2), folder / META)
    resume = argv(init_from="resume", out_dir=str(run.parent), run_name="run", max_steps=3)
    err = one_line_error(train.main, resume, capsys, "train.py")
    assert f"convert it: python -m tooling.convert_checkpoint {folder} {folder}" in err, err
    assert convert_checkpoint.main([str(folder), str(folder)]) == 0
    assert train.main(resume) == 0
    assert checkpoint.load_sharded_meta(str(folder))["state"]["step"] == 3


# ----------------------------------------------------------------------------------------------------
# Optimizer state that does not fit, and failed writes


def test_optimizer_state_of_another_shape_is_refused_at_resume(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path)
    ckpt = checkpoint.load_checkpoint(run / "ckpt.pt")
    ckpt["optimizer"]["state"]["wte.weight"]["exp_avg"] = torch.zeros(3, 5)
    checkpoint.save_file(run / "ckpt.pt", ckpt)
    err = one_line_error(train.main, argv(init_from="resume", out_dir=str(run.parent), run_name="run"),
                         capsys, "train.py")
    assert f"{run / 'ckpt.pt'}: optimizer state wte.weight.exp_avg is stored as torch.float32 of shape [3, 5], the " \
           "optimizer's is torch.float32 of shape [4096, 32]" in err, err


def test_a_failed_write_says_a_checkpoint_is_kept_only_when_there_is_one(tmp_path, monkeypatch):
    ckpt = dict(model_config={}, model={"w": torch.zeros(4)})

    def disk_full(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError) as failed:
        checkpoint.save_file(tmp_path / "ckpt.pt", ckpt)
    assert "the disk is full" in str(failed.value) and "kept" not in str(failed.value), failed.value
    assert str(failed.value).endswith("; there was no previous checkpoint there"), failed.value
    monkeypatch.undo()
    checkpoint.save_file(tmp_path / "ckpt.pt", ckpt)
    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="the disk is full .*; the previous checkpoint there is kept$"):
        checkpoint.save_file(tmp_path / "ckpt.pt", ckpt)
    # a real write past the file size limit (ulimit -f): EFBIG, named, nothing claimed kept
    script = ("import resource, torch\nfrom tooling import checkpoint\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
              f"checkpoint.save_file({str(tmp_path / 'big.pt')!r}, dict(model_config={{}}, "
              "model={'w': torch.zeros(1 << 20)}))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"could not write checkpoint {tmp_path / 'big.pt'}: the file size limit was reached (ulimit -f: 1 MB); " \
           "there was no previous checkpoint there" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "big.pt").exists()
