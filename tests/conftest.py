# Shared test setup. TRITON_INTERPRET must be set before triton is first imported, so it lives here:
# on a machine without CUDA every Triton kernel runs in the interpreter (slow; keep shapes small).
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# one thread: the test models are tiny (thread overhead dominates) and results stay reproducible
torch.set_num_threads(1)


def loop_experts(x, token_of, counts, w_gate_up, w_down, row_weights=None):
    """The reference twin of model.run_experts: each expert in a Python loop over its own tokens (the loop
    reads the tokens per expert to the host, which model.run_experts never does)."""
    sizes = counts.tolist()
    out, x_sorted = torch.zeros_like(x), x[token_of]
    weights = torch.split(row_weights, sizes) if row_weights is not None else [None] * len(sizes)
    for x_e, rows, weight, gate, up, down in zip(torch.split(x_sorted, sizes), torch.split(token_of, sizes), weights,
                                                 *w_gate_up.unbind(1), w_down):
        h = torch.nn.functional.silu(x_e @ gate.t()) * (x_e @ up.t())
        if weight is not None:
            h = h * weight.unsqueeze(1).to(h.dtype)
        out.index_add_(0, rows, (h @ down.t()).to(out.dtype))
    return out


def model_whose_blocks_matter(**config):
    """A random GPT (eval mode) whose blocks matter: at the small nanogpt init the embedding alone decides the
    argmax, so the weight matrices inside the blocks are scaled up 5x. Then the number of passes shows: 1, 2
    and 3 passes gave three different greedy texts in 26 of 30 small looped models drawn, 10 of 30 at 3x."""
    from model import GPT, ModelConfig
    torch.manual_seed(0)
    model = GPT(ModelConfig(**config)).eval()
    with torch.no_grad():
        for p in model.blocks.parameters():
            if p.dim() >= 2:
                p.mul_(5)
    return model


def small_corpus(root):
    """root/corpus.jsonl: a few acts of each source of the embedded corpus (3 of each, 8,000 characters)."""
    from data import prepare as prep
    lines, per_source = [], {}
    with open(prep.DEFAULT_CORPUS) as f:
        for line in f:
            doc = json.loads(line)
            if per_source.get(doc["source"], 0) < 3:
                per_source[doc["source"]] = per_source.get(doc["source"], 0) + 1
                lines.append(json.dumps({"text": doc["text"][:8000], "source": doc["source"]}))
    corpus = root / "corpus.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    return str(corpus)


@pytest.fixture(autouse=True)
def no_process_group_left():
    """A test that ran FSDP2 in this process (train.py keeps its one-rank group) leaves no group behind."""
    yield
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """small_corpus, prepared like the real thing (~30k tokens)."""
    from data import prepare as prep
    root = tmp_path_factory.mktemp("data")
    return prep.prepare([small_corpus(root)], str(root / "prepared"), val_fraction=0.34, seed=0, verbose=False)


@pytest.fixture(scope="session")
def torchrun():
    """Run a script under torchrun with nproc CPU processes (gloo). --standalone picks a free port for
    the rendezvous; a hang fails with the processes' output after `timeout` seconds, never retried."""
    def launch(args, nproc=2, timeout=300, check=True):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
        try:
            result = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                                    text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{nproc}-process torchrun did not finish within {timeout} s: {' '.join(map(str, args))}\n"
                        f"{(e.stderr or b'')[-3000:]}")
        assert result.returncode == 0 or not check, result.stderr[-4000:]
        return result
    return launch
