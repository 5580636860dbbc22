"""
The run folder out_dir/run_name/: its lock, its log, its checkpoints' paths, and what an interrupted
run says.

Guards against: two trainings writing into one folder, temp files a killed write left behind, a log
that runs ahead of (or behind) the checkpoint a run resumes from, and an interrupt (Ctrl-C) or a
non-finite loss that ends a run without saying where its last checkpoint is and how to continue.

    run = RunDir(os.path.join(out_dir, run_name), sharded=False, master=rank == 0)
    with run.hold():                  # makes the folder, takes its lock, removes stale temp files
        with run.on_interrupt():      # Ctrl-C / a non-finite loss: one line with the resume command
            run.save(checkpoint_dict) # the checkpoint first ...
            run.append_log(record)    # ... then its log line: the log never runs ahead
"""

import contextlib
import json
import os
import shutil
import socket

from model import GPT, ModelConfig
from tooling import checkpoint, distributed
from tooling.common import TEMP_MARK, write_atomic

# per command: never carried over from the checkpoint a run forks (init_from) / continues (resume)
NOT_INHERITED_FORK = ("run_name", "init_from", "decay_branch", "decay_tokens", "resume", "stop_at_step",
                      "save_steps", "progress", "sample")
NOT_INHERITED_RESUME = ("resume", "stop_at_step", "progress", "sample")


def resolve_run(settings, overrides):
    """Where a run starts: from scratch, from a checkpoint to fork (init_from: a new run, e.g. a decay
    branch), or from its own checkpoint (resume). Its values: the defaults, the source checkpoint's
    settings (except the per-command ones), the overrides; the model always the checkpoint's.
    settings: train.py's tooling.settings.Settings. Returns (values, source checkpoint or None)."""
    for key, value in overrides.items():
        settings.check(key, value)
    base = settings.defaults | overrides
    resume, source_path = base["resume"], base["init_from"]
    if resume and not source_path:
        run_dir = os.path.join(base["out_dir"], base["run_name"] or "tiny")
        source_path = checkpoint.find_resume_checkpoint(run_dir) if os.path.isdir(run_dir) else None
        if source_path is None:
            raise FileNotFoundError(f"resume=True: no checkpoint to resume in {run_dir} (ckpt.pt or ckpt.dcp)")
    source = checkpoint.load_train_checkpoint(source_path) if source_path else None
    if source is not None:
        model_keys = settings.keys[ModelConfig]
        differ = sorted(k for k in overrides if k in model_keys and overrides[k] != source["model_config"].get(k))
        if differ:
            raise ValueError(f"model settings {differ} differ from the checkpoint {source_path}; "
                             "the model comes from the checkpoint")
    values = settings.resolve(overrides, base=source["train_config"] if source else None,
                              not_inherited=NOT_INHERITED_RESUME if resume else NOT_INHERITED_FORK)
    if source is not None:
        values.update(source["model_config"])
    if not values["run_name"]:
        values["run_name"] = (f"{source['train_config'].get('run_name') or 'run'}_decay{source['state']['step']}"
                              if values["decay_branch"] else "tiny")
    return values, source


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training, with where the last checkpoint is and how to resume."""


class RunDir:
    """One run's folder. sharded: checkpoints are ckpt.dcp/ directories (FSDP), else ckpt.pt files.
    master: this process writes the log and the ckpt.pt files (rank 0)."""

    def __init__(self, path, sharded=False, master=True):
        self.path, self.sharded, self.master = path, sharded, master
        self.saved_step = None  # the step of the last checkpoint this run wrote or resumed from

    @property
    def ckpt_path(self):  # the weights eval_core, probe, grow and sample load
        return os.path.join(self.path, "ckpt.pt")

    @property
    def resume_path(self):  # the checkpoint a resume continues
        return os.path.join(self.path, "ckpt.dcp" if self.sharded else "ckpt.pt")

    @property
    def log_path(self):
        return os.path.join(self.path, "log.jsonl")

    def step_path(self, step):
        return os.path.join(self.path, f"ckpt_step{step}{'.dcp' if self.sharded else '.pt'}")

    @contextlib.contextmanager
    def hold(self):
        """The master makes the folder, takes its lock and removes stale temp files; the others wait."""
        if not self.master:
            yield self
            return
        make_run_dir(self.path)
        with run_dir_lock(self.path):
            remove_stale_temp_files(self.path)
            yield self

    def start_log(self, resumed_from=None):
        """A resumed run cuts its log back to the checkpoint it continues; a new run starts a new log."""
        if not self.master:
            return
        if resumed_from is not None:
            sync_log(self.log_path, resumed_from)
            self.saved_step = resumed_from["state"]["step"]
        elif os.path.exists(self.log_path):
            os.remove(self.log_path)

    def save(self, ckpt, path=None):
        """A sharded checkpoint (every rank its shards) or a file (rank 0); never non-finite weights."""
        path = path or self.resume_path
        if self.sharded:
            checkpoint.save_sharded(path, ckpt)
        elif self.master:
            checkpoint.save_file(path, ckpt)
        if path == self.resume_path:
            self.saved_step = ckpt["state"]["step"]

    def append_log(self, record):
        """One line of log.jsonl (the master writes it); returns the record."""
        if self.master:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    def finish(self, model, optimizers, config, state, data, stream, max_steps, losses, first_position, seconds,
               world):
        """After the training loop: an FSDP run's consolidated weights into ckpt.pt (gathered onto rank 0's CPU,
        one file that eval_core, probe, grow and sample load), the summary dict and the run's last lines.
        Returns (summary, a model to sample from on this rank, or None)."""
        final_model = model
        if self.sharded:
            weights = checkpoint.consolidated_weights(model)  # a collective: every rank
            final_model = None
            if self.master:
                ckpt = checkpoint.training_checkpoint(model, optimizers, config, state, **data.provenance)
                checkpoint.save_file(self.ckpt_path, ckpt | dict(model=weights, optimizer=None))
                if model.num_params()["total"] < 1e9:  # small enough to sample from in one process
                    final_model = GPT(model.config)
                    final_model.load_state_dict(weights)
        read = stream.offsets(first_position, state.data_position - first_position)  # what this run read
        last = state.last_eval or {}
        summary = dict(run_dir=self.path, ckpt_path=self.ckpt_path, resume_path=self.resume_path,
                       log_path=self.log_path, step=state.step, max_steps=max_steps, tokens=state.tokens_seen,
                       flops=state.flops_seen, val_loss=last.get("val_loss"),
                       val_loss_by_source=last.get("val_loss_by_source"), train_losses=losses,
                       unigram_entropy=data.unigram_entropy, data_region=stream.name,
                       data_read=(int(read.min()), int(read.max()) + stream.seq_len + 1) if len(read) else None,
                       data_split=stream.stop if stream.name == "stable" else stream.start,
                       seconds=seconds, world_size=world, rank=distributed.rank())
        if self.master:
            print(run_footer(self, summary, data.unigram_entropy))
        return summary, final_model

    def resume_command(self):
        out_dir, run_name = os.path.split(self.path)
        return f"python train.py --out_dir={out_dir} --run_name={run_name} --resume=True"

    @contextlib.contextmanager
    def on_interrupt(self, step_of):
        """Ctrl-C or a non-finite loss: re-raised with one line saying where the last good checkpoint is
        and how to continue. step_of(): the step the run had reached."""
        try:
            yield
        except checkpoint.NonFiniteLoss as e:
            last = self.resume_path if self.saved_step is not None else "none written yet"
            raise checkpoint.NonFiniteLoss(f"{e}. Stopped; the last good checkpoint is kept: {last}. Lower the "
                                           "learning rates or check the data.") from None
        except KeyboardInterrupt:
            where = (f"the last checkpoint is {self.resume_path} (step {self.saved_step}); continue with: "
                     f"{self.resume_command()}" if self.saved_step is not None else "no checkpoint was written yet")
            raise TrainingInterrupted(f"interrupted at step {step_of()}: {where}") from None



def sync_log(log_path, ckpt):
    """Cut log.jsonl back to the checkpoint being resumed (lines of later steps were written by the
    interrupted run after it), and add the checkpoint's own eval line if the run died before writing it."""
    if not os.path.exists(log_path):
        return
    with open(log_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    kept = [r for r in records if r["step"] <= ckpt["state"]["step"]]
    last_eval = ckpt["state"].get("last_eval")
    if last_eval and (not kept or kept[-1]["step"] < last_eval["step"]):
        kept.append(last_eval)
    if kept != records:
        write_atomic(log_path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in kept).encode()))


def remove_stale_temp_files(run_dir):
    """What a killed checkpoint write left behind in this run's folder: temp files and directories
    (.<name>.tmp-*), and a sharded checkpoint's previous copy once the new one is in place."""
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        stale_old = name.endswith(".old") and os.path.exists(os.path.join(run_dir, name[1:-len(".old")]))
        if name.startswith(".") and (TEMP_MARK in name or stale_old):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


@contextlib.contextmanager
def run_dir_lock(run_dir):
    """Hold run_dir/lock (host and pid) while training: a second training into the same folder stops
    with a clear message; a lock left by a process that no longer exists (on this host) is taken over."""
    path, me = os.path.join(run_dir, "lock"), f"{socket.gethostname()} {os.getpid()}"
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            break
        except FileExistsError:
            try:
                host, pid = open(path).read().split()
            except (OSError, ValueError):  # half-written or vanished: a lock that holds nothing
                host, pid = socket.gethostname(), "0"
            if host == socket.gethostname() and not process_alive(int(pid)):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)  # stale: its process is gone
                continue
            raise ValueError(f"{run_dir} is in use by process {pid} on {host} (lock file {path}); wait for it "
                             "to finish, use another --run_name, or delete the lock file if that process is gone")
    with os.fdopen(fd, "w") as f:
        f.write(me)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if open(path).read() == me:
                os.remove(path)


def process_alive(pid):
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def make_run_dir(run_dir):
    try:
        os.makedirs(run_dir, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"cannot create the run directory {run_dir}: a file is in the way; use another "
                         "--out_dir or --run_name") from None
    except PermissionError:
        raise ValueError(f"cannot create the run directory {run_dir}: permission denied; "
                         "use another --out_dir") from None
    if not os.access(run_dir, os.W_OK):
        raise ValueError(f"the run directory {run_dir} is not writable; use another --out_dir")


# ----------------------------------------------------------------------------------------------------
# What a run prints


def run_header(run, model, data, stream, step, tokens_per_step, max_steps, world, device, bf16):
    """The lines a run starts with: the model and the batch, the data, and whether it has already finished."""
    cfg, counts = model.config, model.num_params()
    finished = (f"\n{run.path} has already finished: step {step} of max_steps {max_steps}. Raise --max_steps to "
                "train further." if step >= max_steps else "")
    return (f"run {run.path}: {cfg.layout} n_layer={cfg.n_layer} n_embd={cfg.n_embd} n_expert={cfg.n_expert} "
            f"passes={cfg.passes}; params total {counts['total']:,} active {counts['active']:,}; "
            f"{tokens_per_step:,} tokens/step x {max_steps} steps; world_size {world}"
            f"{' (FSDP)' if run.sharded else ''}; device {device}{' with bf16 autocast' if bf16 else ''}\n"
            f"data {data.data_dir}: {len(data.train_tokens):,} train tokens ({stream.name} region "
            f"[{stream.start:,}, {stream.stop:,})), unigram entropy of the train split "
            f"{data.unigram_entropy:.3f} nats{finished}")


def run_footer(run, summary, unigram_entropy):
    """The lines a finished run ends with: its last val loss, where its checkpoint and log are."""
    lines = []
    if summary["val_loss"] is not None:
        lines.append(f"step {summary['step']}: val loss {summary['val_loss']:.4f} nats vs unigram entropy "
                     f"{unigram_entropy:.4f} ({summary['tokens']:,} tokens, {summary['flops']:.3e} FLOPs, "
                     f"{summary['seconds']:.0f} s)")
    lines.append(f"checkpoint: {run.ckpt_path}{f' (resume from {run.resume_path})' if run.sharded else ''}")
    lines.append(f"log:        {run.log_path}")
    return "\n".join(lines)


def gpu_memory(device):
    """{"peak_memory_gb": ...} on CUDA (for the log), {} elsewhere."""
    if device.type != "cuda":
        return {}
    import torch
    return {"peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30}
