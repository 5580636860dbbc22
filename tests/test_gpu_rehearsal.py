"""The CUDA path rehearsed where a CPU can rehearse it (no GPU here).

Collectives on the model's device: NCCL has no CPU backend, so a collective handed a CPU tensor while
the model is on a GPU fails at step 0 of the first multi-GPU run, a failure gloo on CPU never shows. Here
the model lives on the meta device (a device that is not the CPU: shapes, no values; fake CUDA tensors
cannot even be sliced on a CPU-only build, whose CUDA device guard is missing), a fake process group of 2
ranks answers every collective at once, and a recording wrapper fails any collective whose tensor is not
on the model's device. The training step, the evaluation and the checkpoint guard run until their first
host sync (`.item()` of a meta tensor raises), after their collectives.

FSDP2's precision: the bf16 policy of tooling.distributed.shard keeps the residual stream in fp32 as
under DDP (real tensors, one gloo process, bf16 autocast on CPU)."""
import numpy as np
import pytest
import torch
import torch.distributed as dist

import train
from data.loader import Data
from model import GPT, ModelConfig
from tooling import checkpoint, distributed

META = torch.device("meta")
# dense (the MoE's tokens per expert are values) and no document mask (whether a sequence holds a
# boundary is a value too: the CPU path asks it)
DENSE = dict(vocab_size=64, eot_token=63, block_size=16, n_layer=2, n_embd=32, n_head=2, layout="plain",
             n_expert=0, document_mask=False)


@pytest.fixture
def fake_group(monkeypatch):
    """A fake 2-rank process group whose collectives must carry tensors on the meta device (the model's);
    yields the devices seen."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    seen = []

    def recording(collective):
        def call(tensor, *args, **kwargs):
            tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
            seen.extend(t.device.type for t in tensors)
            assert all(t.device == META for t in tensors), \
                f"{collective.__name__} of a {tensors[0].device} tensor: with the model on a GPU, NCCL fails here"
            return collective(tensor, *args, **kwargs)
        return call

    for name in ("all_reduce", "all_gather", "broadcast", "gather", "scatter", "reduce_scatter_tensor",
                 "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, recording(getattr(dist, name)))
    try:
        yield seen
    finally:
        dist.destroy_process_group()


def test_evaluation_collectives_are_on_the_model_device(fake_group):
    val = np.zeros(600, dtype=np.uint16)
    data = Data("fake", {"n_vocab": 64, "eot_token": 63, "tokenizer": "gpt2-4096"}, val, val, None, 4.0)
    model = GPT(ModelConfig(**DENSE)).to(META)
    with pytest.raises(RuntimeError, match="meta"):  # the first .item(), after the reductions
        train.evaluate(model, data, train.TrainConfig(batch_size=4, eval_tokens=160), rank=0, world=2)
    assert fake_group.count("meta") >= 2  # CE sums and counts, router statistics


def test_training_step_collectives_are_on_the_model_device(fake_group, monkeypatch, tmp_path, data_dir):
    """train.train on 2 ranks of the meta device up to the step loss's .item(): DDP's wrapper is left out
    (it needs real tensors) and the step-0 eval stubbed (tested above); the loop's own all-reduce of
    the step loss is what is checked."""
    monkeypatch.setattr(distributed, "setup", lambda device, parallel, timeout_s: (0, 2, META))
    monkeypatch.setattr(distributed, "wrap", lambda model, *args, **kwargs: model)
    monkeypatch.setattr(train, "evaluate", lambda *args, **kwargs: {"val_loss": 0.0})
    settings = DENSE | dict(vocab_size=4096, eot_token=4095, batch_size=2, grad_accum=2, max_steps=2,
                            progress=False, sample=False, data_dir=data_dir, out_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="meta"):
        train.train(settings)
    assert fake_group == ["meta"]  # the step's CE, reduced over the ranks


def test_checkpoint_guard_reduces_on_the_weights_device(fake_group):
    weights = [torch.empty(4, 4, device=META), torch.empty(3, device=META)]
    with pytest.raises(RuntimeError, match="meta"):
        checkpoint.check_finite(weights, step=1, path="ckpt.dcp", collective=True)
    assert fake_group == ["meta"]


# ---- FSDP2's mixed precision computes what DDP computes


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{distributed.free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", [dict(n_expert=4, top_k=2, layout="smelt", n_loops=2),
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
