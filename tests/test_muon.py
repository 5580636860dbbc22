"""muon.py: the Newton-Schulz iteration and the Muon optimizer."""
import torch

from muon import orthogonalize


def test_orthogonalize_gives_singular_values_near_one():
    g = torch.Generator().manual_seed(0)
    for shape in [(64, 32), (32, 64), (48, 48), (4, 48, 16)]:  # the last: stacked experts (E, out, in)
        m = torch.randn(*shape, generator=g)
        s = torch.linalg.svdvals(orthogonalize(m))
        assert 0.6 < s.min() and s.max() < 1.25, (shape, s.min(), s.max())
    experts = torch.randn(3, 24, 40, generator=g)
    per_expert = torch.stack([orthogonalize(e) for e in experts])
    torch.testing.assert_close(orthogonalize(experts), per_expert)  # each expert on its own
