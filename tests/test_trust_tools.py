"""A pickled payload in a checkpoint runs through none of the tools; each refuses it in one line."""
import os

import torch

import eval_core
import probe
import sample
from model import GPT, ModelConfig
from test_sample import BUNDLE, error_line, save_checkpoint


class Payload:  # unpickling it runs `touch marker`
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_payload_runs_through_no_tool(tmp_path, capsys):
    model = GPT(ModelConfig(vocab_size=4096, eot_token=4095, n_layer=2, n_embd=32))
    ckpt = save_checkpoint(model, tmp_path / "ok.pt")
    marker = tmp_path / "PWNED"
    torch.save(dict(torch.load(ckpt, weights_only=True), payload=Payload(marker)), tmp_path / "evil.pt")
    evil = str(tmp_path / "evil.pt")
    runs = [(sample.main, [], "sample.py"), (probe.main, [], "probe.py"),
            (eval_core.main, ["--bundle", BUNDLE], "eval_core.py")]
    try:
        import eval_harness
        import lm_eval  # noqa: F401
        runs.append((eval_harness.main, ["--tasks", "hellaswag"], "eval_harness.py"))
    except ImportError:
        pass
    for main, argv, prog in runs:
        assert "evil.pt" in error_line(main, ["--ckpt", evil] + argv, capsys, prog)
        assert not marker.exists(), f"{prog} ran the checkpoint's payload"
    # the same file without the payload loads
    assert sample.main(["--ckpt", ckpt, "--max_new_tokens", "2", "--num_samples", "1"]) == 0
