"""The CUDA path rehearsed where a CPU can rehearse it (no GPU here).

Collectives on the model's device: NCCL has no CPU backend, so a collective handed a CPU tensor while
the model is on a GPU fails under NCCL alone (under setup's "cpu:gloo,cuda:nccl" gloo serves it: a host
copy and a sync per call), what gloo on CPU never shows. Here the model
lives on the meta device (a device that is not the CPU: shapes, no values; fake CUDA tensors cannot even
be sliced on a CPU-only build) and a process group of 2 fake ranks (DeviceCheckedGroup) refuses, and
records, any collective handed a tensor off that device. It is checked at the process group, not by
patching torch.distributed's functions, because that is where every caller ends: dist.*, the functional
collectives of DTensor and FSDP2 (C++ ops), DDP's C++ reducer (test_the_group_refuses_off_device_tensors
shows each reaching it). Torch skips some collectives of meta tensors before the group (the functional
collectives have meta kernels; DTensor's scatter / broadcast return early), so on meta only those are
not counted; handed a CPU tensor they reach the group and are refused.

What runs: train.train on 2 ranks under DDP and under FSDP2 (tooling.distributed.wrap / shard, not
stubbed), both Muon variants, growth mid-run, and resume from a checkpoint, step after step: forward,
backward with its gradient collectives, clip_grad_norm_, AdamW and Muon (under FSDP2 Muon's gather /
scatter of split matrices and the [X] variant's variance-reduction all-reduce), the loss read every
log_interval steps, up to the first save's check of the weights, whose host read (.item()) ends the run.
Allowances, each for torch's own code, never for the project's: the step-0 eval is stubbed (evaluate is
tested by itself); host reads of meta values right after their collectives are tolerated (DDP's check
of parameter shapes across ranks and its rebuild of gradient buckets, guards.read_losses's .tolist()):
the collectives themselves ran through the group; FSDP2 gets a "meta" device handle (its streams and
events are the CPU's no-ops) and its refusal of unmaterialised parameters is lifted.

Not rehearsable without values, left to bench/gpu_check.sh on a GPU: the checkpoint writes and reads
themselves (torch.distributed.checkpoint's save / load of the shards, rank 0's torch.save) and FSDP's
consolidated ckpt.pt at the end (get_model_state_dict gathers to the CPU), whose collectives are torch's
own (DCP's pickled object collectives choose their device from the backend); the evaluation after its
reductions (its first .item()); bf16 autocast (the meta device has none); resume from a ckpt.dcp/ (dcp.load);
the store-backed exchanges of a gloo run (distributed.exchange: setup is stubbed, so no Team), whose
all-reduce of a CPU tensor is gloo's on purpose.

FSDP2's precision: the bf16 policy of tooling.distributed.shard keeps the residual stream in fp32 as
under DDP (real tensors, one gloo process, bf16 autocast on CPU)."""
import contextlib
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.futures import Future

import muon
import train
from data.loader import Data
from model import GPT, ModelConfig
from tooling import checkpoint, distributed, guards

META = torch.device("meta")
DENSE = dict(vocab_size=64, eot_token=63, block_size=16, n_layer=2, n_embd=32, n_head=2, layout="plain",
             n_expert=0, document_mask=False)
# the models train.train rehearses: the tiny default's looped MoE with document masks, and a tied core
# grown into untied copies (new parameters, their optimizer state carried over by name)
SMELT_MOE = dict(n_layer=4, n_expert=4, top_k=2, layout="smelt", n_passes=2, document_mask=True, grow_to=3)
PCC_UNTIE = dict(n_layer=3, n_expert=0, layout="pcc", n_passes=1, grow_to=2, grow_untie=True)


# ---- a process group that refuses tensors off the model's device


def tensors_in(value):
    if torch.is_tensor(value):
        return [value]
    return [t for v in value for t in tensors_in(v)] if isinstance(value, (list, tuple)) else []


class DeviceCheckedGroup(dist.ProcessGroup):
    """`world` fake ranks, this one rank 0: each collective's tensors must be on `device`, else it is
    refused (recorded, then raised); otherwise it completes at once and moves no data. calls: (collective,
    devices, shapes) in order; refused: the same, of the refused ones."""
    device = META

    def __init__(self, rank, world):
        super().__init__(rank, world)
        self.calls, self.refused, self._name = [], [], ""

    def getBackendName(self):
        return "device_checked"

    def setGroupName(self, name):  # the functional collectives find the group by its name
        self._name = name

    def getGroupName(self):
        return self._name

    @property
    def group_name(self):
        return self._name

    def names(self, start=0):
        return [name for name, _, _ in self.calls[start:]]


def collective(name):
    def call(self, *args, **kwargs):
        tensors = tensors_in(args)
        record = (name, [t.device.type for t in tensors], [tuple(t.shape) for t in tensors])
        self.calls.append(record)
        if any(t.device.type != self.device.type for t in tensors):
            self.refused.append(record)
            raise AssertionError(f"{name} handed a tensor on {record[1]}: with the model on a GPU, NCCL fails here")
        done = Future()
        done.set_result(args[0] if args else None)  # the outputs: what DDP's hook reads from the future
        return torch._C._distributed_c10d._create_work_from_future(done)
    return call


# every collective the Python API or C++ (DDP, functional collectives) calls on a group, by the label
# recorded (torch names the tensor forms differently across versions)
for method, label in dict(allreduce="all_reduce", allreduce_coalesced="all_reduce", allgather="all_gather",
                          allgather_coalesced="all_gather", _allgather_base="all_gather_into_tensor",
                          all_gather_single="all_gather_into_tensor",
                          all_gather_single_coalesced="all_gather_into_tensor",
                          allgather_into_tensor_coalesced="all_gather_into_tensor", reduce_scatter="reduce_scatter",
                          _reduce_scatter_base="reduce_scatter_tensor", reduce_scatter_single="reduce_scatter_tensor",
                          reduce_scatter_single_coalesced="reduce_scatter_tensor",
                          reduce_scatter_tensor_coalesced="reduce_scatter_tensor", broadcast="broadcast",
                          gather="gather", scatter="scatter", reduce="reduce", alltoall="all_to_all",
                          all_to_all_single="all_to_all", alltoall_base="all_to_all", barrier="barrier",
                          send="send", recv="recv").items():
    setattr(DeviceCheckedGroup, method, collective(label))

if "device_checked" not in dist.Backend.backend_list:
    dist.Backend.register_backend("device_checked", lambda store, rank, world, timeout: DeviceCheckedGroup(rank, world),
                                  devices=["cpu", "cuda", "meta"])


@contextlib.contextmanager
def checked_group(world=2):
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("device_checked", store=fake_pg.FakeStore(), rank=0, world_size=world)
    try:
        yield dist.distributed_c10d._get_default_group()
    finally:
        dist.destroy_process_group()


@pytest.fixture
def group():
    with checked_group() as g:
        yield g


def test_the_group_refuses_off_device_tensors(group):
    """Every path to the group is checked: dist.*, a functional collective (a C++ op, DTensor's and FSDP2's
    path) and DDP's C++ constructor all reach it with a CPU tensor and are refused; on meta dist.* pass."""
    import torch.distributed._functional_collectives as funcol
    from torch.nn.parallel import DistributedDataParallel

    def calls(device):
        t = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
        return [lambda: dist.all_reduce(t(4)), lambda: dist.broadcast(t(4), 0),
                lambda: dist.all_gather([t(4), t(4)], t(4)), lambda: dist.all_gather_single(t(8), t(4)),
                lambda: dist.reduce_scatter_single(t(4), t(8)), lambda: dist.gather(t(4), [t(4), t(4)], dst=0),
                lambda: dist.scatter(t(4), [t(4), t(4)], src=0),
                lambda: funcol.wait_tensor(funcol.all_reduce(t(4), "sum", group)),
                lambda: funcol.wait_tensor(funcol.all_gather_single(t(4), 0, group))]

    for call in calls(META):
        call()
    assert group.refused == [] and group.names() == ["all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                                                     "reduce_scatter_tensor", "gather", "scatter"]
    cpu_model = torch.nn.Linear(4, 4)
    for i, call in enumerate(calls("cpu") + [lambda: DistributedDataParallel(cpu_model)]):
        with pytest.raises((AssertionError, RuntimeError), match="NCCL fails here"):
            call()
        assert len(group.refused) == i + 1
    assert group.refused[-1][1][0] == "cpu"


def test_evaluation_collectives_are_on_the_model_device(group):
    val = np.zeros(600, dtype=np.uint16)
    data = Data("fake", {"n_vocab": 64, "eot_token": 63, "tokenizer": "gpt2-4096"}, val, val, None, 4.0)
    model = GPT(ModelConfig(**DENSE)).to(META)
    with pytest.raises(RuntimeError, match="meta"):  # the first .item(), after the reductions
        train.evaluate(model, data, train.TrainConfig(batch_size=4, eval_tokens=160), rank=0, world=2)
    assert group.refused == [] and group.names().count("all_reduce") >= 2  # CE sums and counts, bytes


def test_checkpoint_guard_reduces_on_the_weights_device(group):
    weights = [torch.empty(4, 4, device=META), torch.empty(3, device=META)]
    with pytest.raises(RuntimeError, match="meta"):
        checkpoint.check_finite(weights, step=1, path="ckpt.dcp", collective=True)
    assert group.calls == [("all_reduce", ["meta"], [()])] and group.refused == []


# ---- Muon's sharded path, on DTensors of a meta DeviceMesh


@pytest.mark.parametrize("variant", ["original", "x"])
def test_muon_sharded_collectives_are_on_the_model_device(group, variant):
    """FSDP2-shaped parameters (rows split over 2 ranks, uneven; stacked experts split on E): each split
    matrix is gathered to its owner and scattered back, and the [X] variant's variance reduction
    all-reduces once per split matrix (column sums of a wide one, norms of a tall one), all on meta."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh("meta", (2,))

    def sharded(*shape):
        rows = -(-shape[0] // 2)  # rank 0 holds the first ceil(rows / 2)
        local = lambda: torch.empty(rows, *shape[1:], device=META)  # noqa: E731
        spec = dict(run_check=False, shape=torch.Size(shape), stride=torch.empty(shape, device=META).stride())
        p = torch.nn.Parameter(DTensor.from_local(local(), mesh, [Shard(0)], **spec))
        p.grad = DTensor.from_local(local(), mesh, [Shard(0)], **spec)
        return p

    params = [sharded(5, 8), sharded(9, 3), sharded(4, 6, 8)]  # wide, tall, experts (whole on each rank)
    opt = muon.Muon(params, variant=variant)
    for _ in range(2):
        start = len(group.calls)
        opt.step()
        names = group.names(start)
        assert names.count("gather") == names.count("scatter") == 2
        assert names.count("all_reduce") == (2 if variant == "x" else 0)
    assert group.refused == [] and all(d == "meta" for _, devices, _ in group.calls for d in devices)
    assert all(muon.local(v).device == META for s in opt.state.values() for v in s.values())


# ---- the whole training step under DDP and FSDP2


def tolerate_host_read(fn, group, record, fallback=False):
    """fn, with the RuntimeError of a host read of a meta value answered by fallback(*args) (or the value
    fallback); record gets (the error, the collectives fn made before it) of each."""
    def call(*args, **kwargs):
        start = len(group.calls)
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if "meta tensor" not in str(e):
                raise
            record.append((e, group.calls[start:]))
            return fallback(*args) if callable(fallback) else fallback
    return call


def rehearse_on_meta(monkeypatch, group):
    """train.train as rank 0 of 2 on the meta device, DDP and FSDP2 running there (the allowances of the
    module docstring). Returns a record of the run: the optimizer steps (class, the collectives of the
    step), clip calls, the loss reads (step, their collectives), growth (steps before), saves (step, the
    collectives of the weights' check, its error), optimizer state placed (from, as, on), the host reads
    tolerated (error, the collectives before it)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    import torch.nn.parallel.distributed as ddp
    run = types.SimpleNamespace(group=group, steps=[], clips=0, reads=[], grew=[], saves=[], placed=[], tolerated=[],
                                rebuilt=[])
    patch = monkeypatch.setattr
    patch(distributed, "setup", lambda device, parallel, timeout_s=None: (0, 2, META))
    patch(train, "evaluate", lambda *args, **kwargs: {"val_loss": 0.0})
    # DDP: its shape check and bucket rebuild read back what they sent through the group
    patch(ddp, "_verify_param_shape_across_processes",
          tolerate_host_read(ddp._verify_param_shape_across_processes, group, run.tolerated))
    reducer = torch._C._distributed_c10d.Reducer
    rebuild = tolerate_host_read(reducer._rebuild_buckets, group, run.rebuilt)
    patch(reducer, "_rebuild_buckets", lambda self: not run.rebuilt and rebuild(self))  # the bucket order kept
    # FSDP2: a device handle for "meta", and meta parameters allowed to train
    cpu = torch.cpu
    patch(torch, "meta", types.SimpleNamespace(
        current_device=lambda: 0, is_initialized=lambda: True, device_count=lambda: 1, Stream=cpu.Stream,
        Event=cpu.Event, current_stream=cpu.current_stream, stream=cpu.stream, synchronize=cpu.synchronize),
        raising=False)
    patch(FSDPParamGroup, "_validate_no_meta_params", lambda self: None)

    def spy(owner, name, after):
        original = getattr(owner, name)

        def call(*args, **kwargs):
            start = len(group.calls)
            try:
                return original(*args, **kwargs)
            finally:
                after(args, group.calls[start:])
        patch(owner, name, call)
    for cls in (torch.optim.AdamW, muon.Muon):
        spy(cls, "step", lambda args, calls, cls=cls: run.steps.append((cls.__name__, [c[0] for c in calls])))
    spy(torch.nn.utils, "clip_grad_norm_", lambda args, calls: setattr(run, "clips", run.clips + 1))
    spy(train, "grow_during_training", lambda args, calls: run.grew.append(len(run.steps) // 2))
    spy(guards, "read_losses", lambda args, calls: run.reads.append((args[1], calls)))
    patch(guards, "read_losses", tolerate_host_read(guards.read_losses, group, run.tolerated,
                                                    lambda unread, step, world: [0.0] * len(unread)))

    def check_finite(tensors, step, path, collective=False, original=checkpoint.check_finite):
        start = len(group.calls)
        try:
            original(tensors, step, path, collective)
        except RuntimeError as e:
            run.saves.append((step, group.calls[start:], e))
            raise
    patch(checkpoint, "check_finite", check_finite)

    def placed_like(value, template, original=checkpoint.placed_like):
        out = original(value, template)
        if torch.is_tensor(value) and value.dim():
            run.placed.append((value.device.type, type(out).__name__, out.device.type))
        return out
    patch(checkpoint, "placed_like", placed_like)
    return run


@pytest.fixture
def meta_world(monkeypatch, group):
    return rehearse_on_meta(monkeypatch, group)


def settings_of(data_dir, tmp_path, **values):
    return dict(vocab_size=4096, block_size=16, n_embd=32, n_head=2, batch_size=2, global_batch=8,
                max_steps=20, log_interval=3, eval_interval=6, data_dir=data_dir,
                out_dir=str(tmp_path)) | values


def assert_the_run(run, caught, parallel, variant, reads):
    """Steps each: clip, then AdamW and Muon, Muon's collectives those of its parallelism; reads: (step, steps
    read) of the loss reads, each one all-reduce of the steps' losses; the run ended at the first save's
    check of the weights: one all-reduce before its host read under FSDP2 (a sharded checkpoint), none
    for ckpt.pt (rank 0 alone); every host read tolerated came after collectives; nothing refused."""
    n_steps = sum(n for _, n in reads)
    assert [cls for cls, _ in run.steps] == ["AdamW", "Muon"] * n_steps and run.clips == n_steps
    for cls, names in run.steps:
        if cls == "AdamW" or parallel == "ddp":  # whole tensors: nothing to communicate
            assert names == [], (cls, names)
        else:  # each split matrix gathered to its owner, scattered back; [X]: one variance-reduction sum each
            assert names.count("gather") == names.count("scatter") > 0
            assert names.count("all_reduce") == (names.count("gather") if variant == "x" else 0)
    assert run.reads == [(step, [("all_reduce", ["meta"], [(n, 2)])]) for step, n in reads]
    assert run.tolerated and all(calls for _, calls in run.tolerated)
    finite_check = [("all_reduce", ["meta"], [()])] if parallel == "fsdp" else []
    assert [(step, calls) for step, calls, _ in run.saves] == [(6, finite_check)] and caught.value is run.saves[0][2]
    if parallel == "ddp":  # DDP's bucket order, broadcast once, then read back
        assert [[call[:2] for call in calls] for _, calls in run.rebuilt] == [[("broadcast", ["meta"])]]
    assert run.group.refused == [] and all(d == "meta" for _, devices, _ in run.group.calls for d in devices)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("parallel, variant, layout", [("ddp", "original", SMELT_MOE), ("ddp", "x", PCC_UNTIE),
                                                       ("fsdp", "original", PCC_UNTIE), ("fsdp", "x", SMELT_MOE)])
def test_training_steps_keep_every_collective_on_the_model_device(meta_world, data_dir, tmp_path, parallel, variant,
                                                                   layout):
    """6 whole steps (micro-batches of 2, the model grown at step 3) with no host read but the loss reads at
    steps 3 and 6, then the first save, to its check of the weights; the wrapper's own collectives went
    through the group: DDP's parameter broadcast and bucket all-reduces, FSDP2's all-gathers and
    reduce-scatters."""
    settings = settings_of(data_dir, tmp_path, parallel=parallel, optimizer={"original": "muon", "x": "muon_x"}[variant], grow_at=3, **layout)
    with pytest.raises(RuntimeError, match="meta tensor") as caught:
        train.train(settings)
    run = meta_world
    assert_the_run(run, caught, parallel, variant, [(3, 3), (6, 3)])
    assert run.grew == [3]
    names = run.group.names()
    if parallel == "fsdp":
        assert names.count("all_gather_into_tensor") >= 6 and names.count("reduce_scatter_tensor") >= 6
        assert run.placed and all(kind == "DTensor" for _, kind, _ in run.placed)  # growth: state resharded
    else:  # per step an all-reduce of the gradient buckets (the last micro-batch only: no_sync before)
        assert names.count("all_reduce") >= 6 + 2 and "broadcast" in names


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_resumed_steps_keep_every_collective_on_the_model_device(data_dir, tmp_path, monkeypatch, parallel):
    """A one-process CPU run stops after step 1 (its ckpt.pt: CPU tensors); resumed on 2 ranks of the meta
    device, every optimizer state tensor is placed on the model's device (sharded like its parameter
    under FSDP2) and steps 2 to 6 run as above."""
    settings = settings_of(data_dir, tmp_path, optimizer="muon_x", eval_tokens=32, stop_at_step=1, device="cpu")
    assert train.train(settings)["step"] == 1
    saved = checkpoint.load_checkpoint(str(tmp_path / "tiny" / "ckpt.pt"))["optimizer"]["state"]
    n_state = sum(torch.is_tensor(v) and v.dim() > 0 for s in saved.values() for v in s.values())
    with checked_group() as g:
        run = rehearse_on_meta(monkeypatch, g)
        with pytest.raises(RuntimeError, match="meta tensor") as caught:
            train.train(dict(out_dir=str(tmp_path), run_name="tiny", init_from="resume", parallel=parallel))
        assert_the_run(run, caught, parallel, "x", [(3, 2), (6, 3)])
        assert run.placed == [("cpu", "DTensor" if parallel == "fsdp" else "Tensor", "meta")] * n_state


# ---- FSDP2's mixed precision computes what DDP computes


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{distributed.free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", [dict(n_expert=4, top_k=2, layout="smelt", n_passes=2),
                                    dict(layout="pcc", n_layer=3, n_passes=2)])
def test_fsdp_bf16_policy_keeps_the_residual_stream_fp32(one_process_group, layout):
    """Every block's input (the residual stream) is fp32 under the FSDP2 bf16 policy as under DDP's
    autocast, the blocks do gather bf16 weights, and the two losses agree to bf16 precision."""
    cfg = ModelConfig(**(DENSE | dict(document_mask=True, init="nanogpt") | layout))
    torch.manual_seed(0)
    plain = GPT(cfg)
    sharded = GPT(cfg)
    sharded.load_state_dict(plain.state_dict())
    distributed.shard(sharded, torch.device("cpu"), 1, param_dtype=torch.bfloat16)
    idx = torch.randint(0, cfg.eot_token, (2, cfg.block_size), generator=torch.Generator().manual_seed(0))
    idx[:, 5] = cfg.eot_token
    losses = {}
    for name, model in (("ddp", plain), ("fsdp", sharded)):
        inputs, weights = [], []
        hooks = [b.register_forward_pre_hook(lambda m, args: inputs.append(args[0].dtype)) for b in model.blocks]
        hooks.append(model.blocks[0].attn.q_proj.register_forward_pre_hook(
            lambda m, args: weights.append(m.weight.dtype)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[name] = model(idx, idx)[1].float()
        for h in hooks:
            h.remove()
        assert set(inputs) == {torch.float32}, (name, inputs)
        assert set(weights) == {torch.bfloat16 if name == "fsdp" else torch.float32}
    assert losses["fsdp"].item() == pytest.approx(losses["ddp"].item(), rel=2e-2)


def test_consolidated_weights_land_on_one_cpu(one_process_group):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**DENSE))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    distributed.shard(model, torch.device("cpu"), 1)
    weights = checkpoint.consolidated_weights(model)
    assert weights.keys() == expected.keys()
    assert all(weights[k].device.type == "cpu" and torch.equal(weights[k], v) for k, v in expected.items())
