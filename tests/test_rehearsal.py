"""The CUDA code path rehearsed on CPU: bf16 autocast through every layout (forward, backward, generate,
the eval_core and probe entry points), train.py --dtype=bfloat16 (growth, decay branch, resume), and
torch.compile of every layout family (graph breaks and recompiles counted). What CUDA adds beyond this
(nccl, compiled Triton, FlexAttention's backward) is in bench/gpu_check.sh.

Tolerances: bf16 keeps 8 bits of mantissa (relative rounding 2^-9 per operation); through a few layers
of a small random model the loss moves by well under 1% and the gradient keeps its direction."""
import json
import os

import pytest
import torch

import eval_core
import probe
import train
from model import GPT, ModelConfig
from tooling.checkpoint import load_model

VOCAB, EOT = 256, 255
LAYOUTS = {
    "plain-gqa-qknorm": dict(layout="plain", n_kv_head=1, qk_norm=True),
    "smelt-moe": dict(layout="smelt", n_loops=2, n_expert=4, top_k=2, expert_hidden=16),
    "layer-loop": dict(layout="layer_loop", n_loops=2),
    "pcc-tied-boundary": dict(layout="pcc", n_layer=3, n_passes=2, boundary="both", boundary_alpha=0.7,
                              norm_gain=False, qk_norm=True, embed_norm=True),
    "pcc-untied-moe": dict(layout="pcc", n_layer=3, n_passes=2, tie_core=False, n_expert=4, top_k=2),
}


def build(kw, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(**dict(vocab_size=VOCAB, eot_token=EOT, block_size=32, n_layer=4, n_embd=32, n_head=2,
                             init="nanogpt") | kw)
    return GPT(cfg)


def tokens(B=2, T=24):
    idx = torch.randint(0, EOT, (B, T), generator=torch.Generator().manual_seed(1))
    idx[:, 9] = EOT  # a document boundary: the document mask is on
    return idx


@pytest.mark.parametrize("name", LAYOUTS)
def test_bf16_autocast_forward_backward_generate(name):
    idx = tokens()
    losses, grads = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build(LAYOUTS[name])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits, loss = model(idx, idx)
        loss.backward()
        assert torch.isfinite(loss) and logits.dtype == dtype
        grads[dtype] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        assert torch.isfinite(grads[dtype]).all()
        losses[dtype] = loss.item()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = model.generate(idx[:1, :8], 6, temperature=0.0)
        assert out.shape == (1, 14) and int(out.max()) < VOCAB
    assert losses[torch.bfloat16] == pytest.approx(losses[torch.float32], rel=0.01)
    cosine = torch.nn.functional.cosine_similarity(grads[torch.bfloat16], grads[torch.float32], dim=0)
    assert cosine > 0.99, cosine


def test_eval_core_and_probe_entry_points_under_bf16():
    model = build(LAYOUTS["smelt-moe"]).eval()
    seqs = [tokens(1, 20)[0].tolist(), tokens(1, 12)[0].tolist()]
    spans = [(5, 20), (3, 12)]
    fp32, _ = eval_core.score_sequences(model, seqs, spans, pad_id=EOT)
    bf16, _ = eval_core.score_sequences(model, seqs, spans, pad_id=EOT, autocast_dtype=torch.bfloat16)
    for a, b in zip(fp32, bf16):
        assert b.dtype == torch.float32 and a.mean().item() == pytest.approx(b.mean().item(), rel=0.02)
    idx = tokens(2, 24)
    reference = probe.run_probes(model, idx, attn_topk=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = probe.run_probes(model, idx, attn_topk=4)
    assert all(v == v and v >= 0 for v in result["kl"]["curve"])
    for a, b in zip(reference["layers"], result["layers"]):
        assert b["routing_overlap"] == pytest.approx(a["routing_overlap"], abs=0.25)  # a few routing flips
        assert b["cosine"]["Q"] == pytest.approx(a["cosine"]["Q"], abs=0.02)


# ---- train.py --dtype=bfloat16


SMALL = dict(n_layer=2, n_embd=32, n_head=2, n_expert=4, top_k=2, layout="smelt", n_loops=2, block_size=32,
             batch_size=4, eval_tokens=256, warmup_steps=2, eval_interval=100, progress=False, sample=False,
             dtype="bfloat16")


def test_train_bf16_default_family_loss_falls_and_resume_is_exact(tmp_path, data_dir):
    common = SMALL | dict(data_dir=data_dir, max_steps=12, eval_interval=6, matrix_lr=0.03)
    straight = train.train(common | dict(out_dir=str(tmp_path / "a")))
    losses = straight["train_losses"]
    assert all(map(lambda v: v == v, losses)) and sum(losses[-3:]) / 3 < losses[0] - 0.5
    first = train.train(common | dict(out_dir=str(tmp_path / "b"), stop_at_step=6))
    second = train.train(dict(out_dir=str(tmp_path / "b"), resume=True, progress=False))
    assert first["train_losses"] + second["train_losses"] == losses  # same machine, same ops: bitwise


@pytest.mark.parametrize("untie", [False, True])
def test_train_bf16_growth_and_decay_branch(tmp_path, data_dir, untie):
    pcc = SMALL | dict(data_dir=data_dir, out_dir=str(tmp_path), run_name="stable", layout="pcc", n_layer=3,
                       n_passes=1, n_expert=0, boundary_alpha=0.7, max_steps=6, grow_at=3.0, grow_to=2,
                       grow_untie=untie, decay_fraction=0.0, save_steps=[6])
    stable = train.train(pcc)
    model, ckpt = load_model(stable["ckpt_path"])
    assert ckpt["state"]["grown"] and model.config.n_passes == 2 and model.config.tie_core == (not untie)
    branch = train.train(dict(out_dir=str(tmp_path), init_from=os.path.join(stable["run_dir"], "ckpt_step6.pt"),
                              decay_branch=True, decay_tokens=3 * 4 * 32, progress=False))
    assert branch["step"] == 9 and all(v == v for v in branch["train_losses"])
    log = [json.loads(line) for line in open(branch["log_path"])]
    assert log[-1]["lr"] == 0.0  # decayed to the floor, in bf16 like its stable phase (dtype is inherited)


# ---- torch.compile: graph breaks and recompiles per layout family


@pytest.mark.parametrize("name", LAYOUTS)
def test_compile_does_not_recompile_every_step(name):
    """Dynamo decides graph breaks and recompiles before any backend runs, so the aot_eager backend (trace
    forward and backward, no code generation) rehearses that part of --compile=True in seconds. After the
    first step no new graph may appear: MoE routing changes the tokens per expert every step, and a
    recompile per step would make --compile useless on a GPU."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = build(LAYOUTS[name])
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    graphs = []
    for step in range(4):
        idx = torch.randint(0, EOT, (4, 32), generator=torch.Generator().manual_seed(step))
        idx[:, 7 + step] = EOT  # the document boundary moves: the mask changes every step
        _, loss = compiled(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    breaks = sum(counters["graph_break"].values())
    print(f"{name}: {graphs[-1]} graphs, {breaks} graph breaks")
    assert graphs[1] == graphs[-1], f"{name} recompiles after the first step: {graphs}"
    if "moe" not in name:  # MoE: the tokens per expert are data (a break before the expert loop, see README)
        assert breaks == 0, dict(counters["graph_break"])


def test_train_with_compile_matches_eager(tmp_path, data_dir):
    """train.py --compile=True with the real (inductor, C++ on CPU) backend, one dense layout family
    (~30 s of compilation on 2 cores): the same losses as eager within fp32 fusion rounding."""
    settings = SMALL | dict(data_dir=data_dir, dtype="float32", layout="pcc", n_layer=3, n_passes=2, n_expert=0,
                            max_steps=3, optimizer="adamw")
    eager = train.train(settings | dict(out_dir=str(tmp_path / "eager")))
    compiled = train.train(settings | dict(out_dir=str(tmp_path / "compiled"), compile=True))
    assert compiled["train_losses"] == pytest.approx(eager["train_losses"], rel=1e-4)
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-4)
