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
import signal
import socket
import sys
import threading
import time

from model import GPT, ModelConfig
from tooling import checkpoint, distributed, guards, weights
from tooling.common import TEMP_MARK, Terminated, cli_error, signals_deferred, write_atomic

# per command: never carried over from the checkpoint a run forks (init_from) / continues (resume). Paths
# are never taken from a checkpoint: a run writes where its command says (out_dir, run_name), and reads
# the checkpoint's data_dir only when the command gives none and that folder still exists (said in the log).
NOT_INHERITED_FORK = ("run_name", "out_dir", "data_dir", "init_from", "decay_tokens", "stop_at_step",
                      "save_steps")
NOT_INHERITED_RESUME = ("run_name", "out_dir", "data_dir", "init_from",
                        "stop_at_step")  # a resumed fork or branch starts from its own checkpoint, not its source
BATCH_KEYS = ("batch_size", "global_batch")


def resolve_run(settings, overrides):
    """Where a run starts: from scratch, from a checkpoint to fork (init_from: a new run, e.g. a decay
    branch), or from its own checkpoint (resume). Its values: the defaults, the source checkpoint's
    settings (except the per-command ones and paths), the overrides; the model always the checkpoint's.
    settings: train.py's tooling.settings.Settings. Returns (values, source checkpoint or None, notes: lines
    for the log)."""
    for key, value in overrides.items():
        settings.check(key, value)
    given = {key for key, value in overrides.items() if value not in (settings.defaults[key], settings.declared[key])}
    base = settings.defaults | overrides
    resume, source_path = base["init_from"] == "resume", base["init_from"]
    if resume:
        run_dir = os.path.join(base["out_dir"], base["run_name"] or "tiny")
        source_path = checkpoint.find_resume_checkpoint(run_dir) if os.path.isdir(run_dir) else None
        if source_path is None:
            raise FileNotFoundError(f"init_from=resume: no checkpoint to resume in {run_dir} (ckpt.pt or ckpt.dcp)")
    notes = []
    if source_path and not resume and weights.is_export(source_path):  # shared weights: a new run from them
        source = exported_source(source_path, base, notes)
    else:
        source = checkpoint.load_train_checkpoint(source_path) if source_path else None
    if source is not None:
        model_keys = settings.keys[ModelConfig]
        differ = sorted(k for k in overrides if k in model_keys and overrides[k] != source["model_config"].get(k))
        if differ:
            raise ValueError(f"model settings {differ} differ from the checkpoint {source_path}; "
                             "the model comes from the checkpoint")
        if "data_dir" not in overrides and not source.get("export"):
            overrides = dict(overrides, data_dir=inherited_data_dir(source, source_path, notes))
        overrides = dict(overrides, **kept_global_batch(source, overrides, resume))
    values = settings.resolve(overrides, base=source["train_config"] if source else None,
                              not_inherited=NOT_INHERITED_RESUME if resume else NOT_INHERITED_FORK)
    if source is not None:
        values.update(source["model_config"])
    values["decay_branch"] = is_decay_branch(values, source, resume)  # not a setting: TrainConfig.decay_branch
    guards.check_inert(values, given)
    if values["decay_branch"] and not resume:
        guards.check_branch_source(source, source_path)
        if values["branch_data_fraction"] == 0.0:
            raise ValueError(f"decay_tokens={values['decay_tokens']}: a decay branch reads the held-back data, but "
                             f"{source_path} held none back (branch_data_fraction=0.0)")
    if not values["run_name"]:
        values["run_name"] = (branch_run_name(source["train_config"].get("run_name"), source["state"]["step"])
                              if values["decay_branch"] and not resume else "tiny")
    return values, source, notes


def is_decay_branch(values, source, resume):
    """[S] a decay branch: a fork of a training checkpoint with decay_tokens > 0, or a branch resumed (its
    state records the step it forked at). A stable run's decay_tokens only plan its branches."""
    if source is None or source.get("export"):
        return False
    if resume:
        return source["state"].get("branch_start_step") is not None
    return values["decay_tokens"] > 0


def exported_source(path, base, notes):
    """An export folder (python -m tooling.export) as the source of a new run: its model and weights only;
    step 0, a fresh optimizer, the command's data and settings. A decay branch needs a training checkpoint."""
    if base["decay_tokens"] > 0:
        raise ValueError(f"init_from={path} with decay_tokens > 0 (a decay branch): an export holds weights only "
                         "(no step, schedule or data position); "
                         "a decay branch forks a training checkpoint (ckpt.pt / ckpt_step<N>.pt)")
    model_config, state_dict, info = weights.load_exported_state(path)
    trained = info.get("trained") or {}
    notes.append(f"weights from the export {path} (step {trained.get('step')} of {trained.get('run_name')!r}): "
                 "a new run from step 0 with a fresh optimizer")
    return dict(path=path, export=True, model_config=model_config, model=state_dict, train_config={}, state={},
                tokenizer=info.get("tokenizer"))


def branch_run_name(source_run_name, step):
    """The default name of a decay branch: <its source run>_decay<the step it forks at> [S]."""
    return f"{source_run_name or 'run'}_decay{step}"


def inherited_data_dir(source, source_path, notes):
    """The checkpoint's data_dir when the command gives none: only if it still exists ("" is the embedded
    corpus), and said in the log."""
    data_dir = source["train_config"].get("data_dir", "")
    if data_dir and not os.path.isdir(data_dir):
        raise ValueError(f"the checkpoint {source_path} was trained on data_dir={data_dir!r}, which does not exist "
                         "here (moved?); give --data_dir")
    notes.append(f"data_dir from the checkpoint {source_path}: {data_dir or '(the embedded corpus)'}")
    return data_dir


def kept_global_batch(source, overrides, resume):
    """A run continued or forked onto another number of processes keeps its sequences per step: global_batch
    set to the checkpoint's, so grad_accum follows from the world size. Changing it takes --global_batch."""
    recorded = source["state"].get("seqs_per_step", 0)
    return {"global_batch": recorded} if recorded and "global_batch" not in overrides else {}


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during training, with where the last checkpoint is and how to resume."""

    def __init__(self, message, exit_status=130):
        super().__init__(message)
        self.exit_status = exit_status  # 130 after Ctrl-C, 143 after SIGTERM (128 + the signal), as shells report


PeerFailure = distributed.PeerFailure  # another process of the run failed, died or stopped answering


def raise_terminated(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Inside: SIGTERM raises Terminated (only the main thread can take signals; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_cli(prog, run):
    """train.py's command line around run(): one line and an exit status for every way it can end. Ctrl-C or
    SIGTERM during training: where the checkpoint is and how to resume (rank 0), 130 / 143; before the run
    folder is held (loading, checks): that nothing was written; a bad setting, file, peer or loss: one line,
    2. With several processes, a rank's own failure is "rank r: ..." and recorded for the others, which
    print that line (distributed.ended_by), also when torchrun's SIGTERM reaches them first. The process
    group is torn down in every case."""
    try:
        with sigterm_as_interrupt():
            run()
    except KeyboardInterrupt as e:
        cause = distributed.recorded_failure()  # torchrun stops the others when one process fails
        if cause:
            return cli_error(prog, PeerFailure(cause, cause))
        if isinstance(e, TrainingInterrupted):
            if distributed.rank() == 0:
                print(f"\n{prog}: {e}", file=sys.stderr)
            return e.exit_status
        if distributed.rank() == 0:  # before training began: nothing of the run was written
            print(f"\n{prog}: {'terminated' if isinstance(e, Terminated) else 'interrupted'} before training "
                  "began; nothing was written", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except (ValueError, OSError, checkpoint.NonFiniteLoss, PeerFailure) as e:
        return cli_error(prog, distributed.ended_by(e))
    finally:
        distributed.teardown()
    return 0


class RunDir:
    """One run's folder. sharded: checkpoints are ckpt.dcp/ directories (FSDP), else ckpt.pt files.
    master: this process writes the log and the ckpt.pt files (rank 0). world: processes of the run.
    saving=False: no checkpoint is written at all, the log is (a benchmark: bench/gpu_check.sh)."""

    def __init__(self, path, sharded=False, master=True, world=1, saving=True):
        self.path, self.sharded, self.master, self.world, self.saving = path, sharded, master, world, saving
        self.saved_step = None  # the step of the last checkpoint this run wrote or resumed from
        self.pending = []  # log lines waiting for the first checkpoint (the log never runs ahead of it)

    @classmethod
    def of(cls, config, rank, world):
        """The folder of a run with train.py's settings `config`, for this process of world."""
        return cls(os.path.join(config.out_dir, config.run_name), config.sharded, rank == 0, world,
                   config.save_checkpoints)

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

    def run_files(self):
        """What a run leaves in its folder: the log and the checkpoints."""
        if not os.path.isdir(self.path):
            return []
        return sorted(n for n in os.listdir(self.path) if n == "log.jsonl" or
                      (n.startswith("ckpt") and (n.endswith((".pt", ".dcp")))))

    @contextlib.contextmanager
    def hold(self, resumed_from=None):
        """The master makes the folder, takes its lock and removes stale temp files; the others wait for it
        (an exchange: a refusal on the master ends them too, with its line). A sharded run's other ranks then
        check that they see the master's lock: every rank writes its shards into this folder. A resumed run
        (resumed_from: its checkpoint) cuts its log back to it; a new run into a folder that holds a run is
        refused (a run deleted by hand is started over). A folder this call made is removed again if the run ends
        leaving it empty."""
        if resumed_from:
            self.saved_step = resumed_from["state"]["step"]
        if not self.master:
            lock = distributed.exchange("the run folder")[0]
            if self.sharded:
                check_shared_folder(self.path, lock)
            yield self
            return
        created = not os.path.isdir(self.path)
        make_run_dir(self.path)
        try:
            with run_dir_lock(self.path) as lock:
                remove_stale_temp_files(self.path)
                found = self.run_files()
                if resumed_from:
                    sync_log(self.log_path, resumed_from)
                elif found:
                    raise ValueError(f"{self.path} already holds a run ({', '.join(found)}): continue it with "
                                     "--init_from=resume, or use another --run_name (or delete the folder to start "
                                     "it over)")
                distributed.exchange("the run folder", lock)
                yield self
        finally:
            if created and os.path.isdir(self.path) and not os.listdir(self.path):
                os.rmdir(self.path)

    def save_training(self, model, optimizers, config, state, data, path=None):
        """The training checkpoint of now (weights, optimizer state, settings, state, data provenance)."""
        self.save(checkpoint.training_checkpoint(model, optimizers, config, state, **data.provenance), path)

    def save(self, ckpt, path=None):
        """A sharded checkpoint (every rank its shards) or a file (rank 0); never non-finite weights."""
        if not self.saving:
            return
        path = path or self.resume_path
        if path == self.resume_path and self.pending:  # log lines not written yet: resume writes them if we die
            ckpt = dict(ckpt, unlogged=list(self.pending))
        with signals_deferred():
            if self.sharded:
                checkpoint.save_sharded(path, ckpt)
            elif self.master:
                checkpoint.save_file(path, ckpt)
        if path == self.resume_path:
            self.saved_step = ckpt["state"]["step"]

    def append_log(self, record, wait_for_checkpoint=False):
        """One line of log.jsonl (the master writes it); returns the record. wait_for_checkpoint: written
        with the next line after the run's first checkpoint (the step-0 eval)."""
        if self.master:
            self.pending.append(record)
            if self.saved_step is not None or not (wait_for_checkpoint and self.saving):
                text = "".join(json.dumps(r) + "\n" for r in self.pending)
                try:
                    with signals_deferred(), open(self.log_path, "a") as f:
                        f.write(text)
                except OSError as e:
                    kept = f"{self.resume_path} (step {self.saved_step})" if self.saved_step is not None else "none"
                    raise OSError(f"could not write the log {self.log_path}: {e.strerror or e}; the last checkpoint "
                                  f"is kept: {kept}") from None
                self.pending = []
        return record

    def consolidate(self, model, optimizers, config, state, data):
        """After the training loop: an FSDP run's consolidated weights into ckpt.pt (gathered onto rank 0's CPU,
        one file that eval_core, probe, grow and sample load). Returns a model to sample from on this rank,
        or None."""
        final_model = model
        if self.sharded and not self.saving:
            final_model = None
        elif self.sharded:
            weights = checkpoint.consolidated_weights(model)  # a collective: every rank
            final_model = None
            if self.master:
                ckpt = checkpoint.training_checkpoint(model, optimizers, config, state, **data.provenance)
                checkpoint.save_file(self.ckpt_path, ckpt | dict(model=weights, optimizer=None))
                if model.num_params()["total"] < 1e9:  # small enough to sample from in one process
                    final_model = GPT(model.config)
                    final_model.load_state_dict(weights)
        return final_model

    def summary(self, state, max_steps, data, stream, losses, first_position, t0):
        """The run's summary dict (what train.train returns; t0: when its loop began), its footer printed
        by rank 0."""
        seconds = time.time() - t0
        read = stream.offsets(first_position, state.data_position - first_position)  # what this run read
        last = state.last_eval or {}
        summary = dict(run_dir=self.path, ckpt_path=self.ckpt_path if self.saving else None,
                       resume_path=self.resume_path if self.saving else None,
                       log_path=self.log_path, step=state.step, max_steps=max_steps, tokens=state.tokens_seen,
                       flops=state.flops_seen, val_loss=last.get("val_loss"), val_bpb=last.get("val_bpb"),
                       val_loss_by_source=last.get("val_loss_by_source"), train_losses=losses,
                       unigram_entropy=data.unigram_entropy, data_region=stream.name,
                       data_read=(int(read.min()), int(read.max()) + stream.seq_len + 1) if len(read) else None,
                       data_split=stream.stop if stream.name == "stable" else stream.start,
                       seconds=seconds, world_size=self.world, rank=distributed.rank())
        if self.master:
            print(run_footer(self, summary, data.unigram_entropy))
        return summary

    def resume_command(self):
        out_dir, run_name = os.path.split(self.path)
        launch = f"torchrun --nproc_per_node={self.world} train.py" if self.world > 1 else "python train.py"
        return f"{launch} --out_dir={out_dir} --run_name={run_name} --init_from=resume"

    def where(self):
        return (f"the last checkpoint is {self.resume_path} (step {self.saved_step}); continue with: "
                f"{self.resume_command()}" if self.saved_step is not None else "no checkpoint was written yet")

    @contextlib.contextmanager
    def on_interrupt(self, step_of):
        """Ctrl-C, SIGTERM, a non-finite loss or a peer process that died or stalled: re-raised with one
        line saying where the last good checkpoint is and how to continue. step_of(): the step reached."""
        try:
            with sigterm_as_interrupt():
                yield
        except checkpoint.NonFiniteLoss as e:
            last = self.resume_path if self.saved_step is not None else "none written yet"
            where = "" if getattr(e, "says_kept", False) else f"; the last good checkpoint is kept: {last}"
            error = checkpoint.NonFiniteLoss(f"{e}. Stopped{where}. Lower the learning rates or check the data.")
            error.every_rank = e.every_rank
            raise error from None
        except Terminated:
            raise TrainingInterrupted(f"terminated (SIGTERM) at step {step_of()}: {self.where()}", 143) from None
        except KeyboardInterrupt:
            raise TrainingInterrupted(f"interrupted at step {step_of()}: {self.where()}") from None
        except RuntimeError as e:
            if self.world == 1 or not distributed.peer_failure(e):
                raise
            cause = getattr(e, "cause", None) or distributed.recorded_failure()  # another rank's own line
            if cause:
                raise PeerFailure(cause, cause) from None
            reason = getattr(e, "reason", None) or distributed.failure_reason(e)
            raise PeerFailure(f"another process of the run died or stopped answering at step {step_of()} "
                              f"({reason}); {self.where()}") from None


def sync_log(log_path, ckpt):
    """Cut log.jsonl back to the checkpoint being resumed (lines of later steps were written by the
    interrupted run after it), and add the lines the run died before writing: the checkpoint's own eval and
    any it carries as "unlogged" (the step-0 eval waits for the first checkpoint). A last line cut short (the
    process killed mid-write) is dropped; any other bad line is named."""
    text = b""
    if os.path.exists(log_path):
        with open(log_path, "rb") as f:
            text = f.read()
    if text and not text.endswith(b"\n"):  # a line the interrupted run did not finish writing
        text = text[:text.rfind(b"\n") + 1]
    records = []
    for lineno, line in enumerate(text.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{log_path}:{lineno}: malformed JSON ({e.msg}); fix or delete that line (the "
                             "checkpoint is not affected) and resume again") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{log_path}:{lineno}: not a log record (no integer 'step'); fix or delete that line "
                             "and resume again")
        records.append(record)
    kept = [r for r in records if r["step"] <= ckpt["state"]["step"]]
    logged = {r["step"] for r in kept}
    for record in [*ckpt.get("unlogged", []), ckpt["state"].get("last_eval")]:
        if record and record["step"] not in logged:
            kept.append(record)
            logged.add(record["step"])
    kept.sort(key=lambda r: r["step"])
    if kept != records or (os.path.exists(log_path) and len(text) != os.path.getsize(log_path)):
        write_atomic(log_path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in kept).encode()))


def run_folder_of(folder):
    """The run folder a file written into `folder` lands in: folder itself, or its parent (a subfolder such
    as out/run/probe), when it holds a run (a lock, log.jsonl or a checkpoint); else None."""
    folder = os.path.abspath(folder)
    for candidate in (folder, os.path.dirname(folder)):
        if os.path.isdir(candidate) and (os.path.exists(os.path.join(candidate, "lock")) or
                                         RunDir(candidate).run_files()):
            return candidate
    return None


@contextlib.contextmanager
def run_folder_held(folder, elsewhere):
    """Inside: the lock of run_folder_of(folder) (run_dir_lock, the one train.py holds), so no training
    writes there meanwhile; outside any run folder there is nothing to hold. A folder another process holds
    is refused in run_dir_lock's line, ending in `elsewhere` (how to write somewhere else instead)."""
    run = run_folder_of(folder)
    with run_dir_lock(run, elsewhere) if run else contextlib.nullcontext():
        yield run


def remove_stale_temp_files(run_dir):
    """What a killed checkpoint write left behind in this run's folder: temp files and directories
    (.<name>.tmp-*), and a sharded checkpoint's previous copy once the new one is in place."""
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        stale_old = name.endswith(".old") and os.path.exists(os.path.join(run_dir, name[1:-len(".old")]))
        if name.startswith(".") and (TEMP_MARK in name or stale_old):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def check_shared_folder(run_dir, lock, wait_s=5.0):
    """Refuse a sharded run whose folder this process does not share with rank 0 (which wrote `lock` into
    run_dir/lock): its shards would land in another folder than rank 0's. A network filesystem may show a
    new file late: looked for again for up to wait_s."""
    path, deadline = os.path.join(run_dir, "lock"), time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError):
            if open(path).read() == lock:
                return
        if time.monotonic() > deadline:
            raise ValueError(f"{path} (rank 0's lock) is not there for this process: a sharded (FSDP) run writes every "
                             "rank's shards into one folder, so out_dir must be on a filesystem every node shares")
        time.sleep(0.1)


@contextlib.contextmanager
def run_dir_lock(run_dir, instead="use another --run_name"):
    """Hold run_dir/lock ("host pid start-time") while training (or a tool writes there): a second process
    into the same folder stops with a clear message ending in what to do `instead`; a lock left by a process
    that no longer exists (on this host) is taken over; one naming another host is refused with how to take
    it over. The lock appears whole or not at all (written beside it, then linked into place), so a full
    disk never leaves an empty lock."""
    path, host = os.path.join(run_dir, "lock"), socket.gethostname()
    me = f"{host} {os.getpid()} {time.strftime('%Y-%m-%dT%H:%M:%S')}"
    while True:
        try:
            create_lock(path, me)
            break
        except FileExistsError:
            try:
                holder_host, pid, *since = open(path).read().split()
                pid = int(pid)
            except (OSError, ValueError):  # empty or vanished (an older loopstudy's half-written lock)
                holder_host, pid, since = host, 0, []
            if holder_host == host and not process_alive(pid):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)  # stale: its process is gone
                continue
            when = f" since {since[0]}" if since else ""
            if holder_host != host:
                raise ValueError(f"{run_dir} is locked by process {pid} on host {holder_host}{when} (lock file "
                                 f"{path}); this host cannot tell whether it still runs: if it has ended, delete the "
                                 f"lock to take the folder over (rm {path}), or {instead}") from None
            raise ValueError(f"{run_dir} is in use by process {pid} on this host{when} (lock file {path}); wait for "
                             f"it to finish, or {instead}") from None
        except OSError as e:
            raise OSError(f"cannot write the lock file {path}: {e.strerror or e}") from None
    try:
        yield me
    finally:
        with contextlib.suppress(OSError):
            if open(path).read() == me:
                os.remove(path)


def create_lock(path, text):
    """Create the lock file holding text, whole, or raise FileExistsError: text written beside it, then
    hard-linked into place (exclusive, like O_EXCL); on a filesystem without hard links, O_EXCL then write."""
    directory, host = os.path.dirname(path), socket.gethostname()
    mine = os.path.join(directory, f".lock{TEMP_MARK}{host}-{os.getpid()}")  # this process's alone
    write_atomic(mine, lambda f: f.write(text.encode()))
    try:
        os.link(mine, path)
    except FileExistsError:
        raise
    except OSError:  # no hard links here
        with os.fdopen(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666), "w") as f:
            f.write(text)
    finally:
        os.remove(mine)


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


def run_header(run, model, data, stream, step, tokens_per_step, max_steps, world, device, bf16, notes=()):
    """The lines a run starts with: the model and the batch, the data (notes: where settings came from), and
    whether it has already finished."""
    cfg, counts = model.config, model.num_params()
    finished = (f"\n{run.path} has already finished: step {step} of max_steps {max_steps}. Raise --max_steps to "
                "train further." if step >= max_steps else "")
    return (f"run {run.path}: {cfg.layout} n_layer={cfg.n_layer} n_embd={cfg.n_embd} n_expert={cfg.n_expert} "
            f"passes={cfg.n_passes}; params total {counts['total']:,} active {counts['active']:,}; "
            f"{tokens_per_step:,} tokens/step x {max_steps} steps; world_size {world}"
            f"{' (FSDP)' if run.sharded else ''}; device {device}{' with bf16 autocast' if bf16 else ''}\n"
            f"data {data.data_dir}: {len(data.train_tokens):,} train tokens ({stream.name} region "
            f"[{stream.start:,}, {stream.stop:,})), unigram entropy of the train split "
            f"{data.unigram_entropy:.3f} nats{''.join(chr(10) + n for n in notes if n)}{finished}")


def run_footer(run, summary, unigram_entropy):
    """The lines a finished run ends with: its last val loss, where its checkpoint and log are."""
    lines = []
    if summary["val_loss"] is not None:
        bpb = f" ({summary['val_bpb']:.4f} bits/byte)" if summary.get("val_bpb") is not None else ""
        lines.append(f"step {summary['step']}: val loss {summary['val_loss']:.4f} nats{bpb} vs unigram entropy "
                     f"{unigram_entropy:.4f} ({summary['tokens']:,} tokens, {summary['flops']:.3e} FLOPs, "
                     f"{summary['seconds']:.0f} s)")
    if run.saving and summary["step"] < summary["max_steps"]:  # stop_at_step
        lines.append(f"stopped at step {summary['step']} of {summary['max_steps']}; continue with: "
                     f"{run.resume_command()}")
    if not run.saving:
        lines.append("checkpoint: none (save_checkpoints=False)")
    else:
        lines.append(f"checkpoint: {run.ckpt_path}{f' (resume from {run.resume_path})' if run.sharded else ''}")
    lines.append(f"log:        {run.log_path}")
    return "\n".join(lines)


def gpu_memory(device):
    """{"peak_memory_gb": ...} on CUDA (for the log), {} elsewhere."""
    if device.type != "cuda":
        return {}
    import torch
    return {"peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30}
