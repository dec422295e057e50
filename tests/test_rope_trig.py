"""RoPE tables: cos and sin by steadyserve's fixed float64 method (models/rope_trig.py), never the library's.

An Intel Xeon process now and then built a float32 cos table off by about 1.5e-4 through PyTorch's own
`cos` (a contended second thread at load time); every logprob of that process then missed the published
receipts. These tests pin the method: it is accurate (the float32 rounding of the C library's float64
cos and sin), it does not touch PyTorch's transcendental functions at all, and its range is checked.
"""

from __future__ import annotations

import math

import pytest
import torch

from steadyserve.models.args import rope_tables
from steadyserve.models.loader import load_model
from steadyserve.models.rope_trig import cos_sin


def _angles(max_len: int, theta: float, dim: int) -> torch.Tensor:
    """(max_len, dim/2) float32 angles, exactly as rope_tables forms them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]


@pytest.mark.parametrize("max_len,theta,dim", [(8192, 100000.0, 64), (131072, 500000.0, 128)])
def test_cos_sin_are_the_rounded_float64_values(max_len: int, theta: float, dim: int) -> None:
    """Every sampled angle's cos and sin equal float32(math.cos(x)) and float32(math.sin(x)): the method is
    as accurate as a float32 table can be (the library's float32 cos misses this in about 5% of entries)."""
    angles = _angles(max_len, theta, dim).flatten()
    idx = torch.randint(0, angles.numel(), (40000,), generator=torch.Generator().manual_seed(1))
    x = angles[idx]
    cos, sin = cos_sin(x)
    ref_cos = torch.tensor([math.cos(v) for v in x.tolist()], dtype=torch.float64).float()
    ref_sin = torch.tensor([math.sin(v) for v in x.tolist()], dtype=torch.float64).float()
    assert cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos, ref_cos), int((cos != ref_cos).sum())
    assert torch.equal(sin, ref_sin), int((sin != ref_sin).sum())


def test_scaling_is_applied_in_float64_and_rounded_once() -> None:
    x = torch.tensor([0.0, 0.5, 3.0, 1000.25, 123456.0])
    cos, sin = cos_sin(x, 1.25)
    assert cos.tolist() == torch.tensor([math.cos(v) * 1.25 for v in x.tolist()], dtype=torch.float64).float().tolist()
    assert sin.tolist() == torch.tensor([math.sin(v) * 1.25 for v in x.tolist()], dtype=torch.float64).float().tolist()


@pytest.mark.parametrize("bad", [-1.0, float(2 ** 20), float("nan"), float("inf")])
def test_angles_outside_the_reduced_range_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="RoPE angles"):
        cos_sin(torch.tensor([0.0, bad]))


def test_rope_tables_never_call_torch_transcendentals(monkeypatch: pytest.MonkeyPatch, tiny_model: str) -> None:
    """With PyTorch's cos and sin made to fail, a model's tables still build, bit-equal to the loaded model's:
    nothing in them depends on which math library PyTorch dispatches to or on its state."""
    loaded = load_model(tiny_model, numerics="portable")
    want_cos, want_sin = rope_tables(loaded.model.args, loaded.model.cos.shape[0])
    assert torch.equal(want_cos, loaded.model.cos) and torch.equal(want_sin, loaded.model.sin)

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("a RoPE table called PyTorch's cos or sin")

    for name in ("cos", "sin"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
        monkeypatch.setattr(torch, name, refuse)
    cos, sin = rope_tables(loaded.model.args, loaded.model.cos.shape[0])
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_the_blocks_change_no_value() -> None:
    """cos_sin runs the method block by block (a 128k-position table at once was 14x slower); each op is
    elementwise, so the result must be the one pass over the whole array's, bit for bit."""
    from steadyserve.models import rope_trig

    g = torch.Generator().manual_seed(3)
    angles = torch.rand(3 * rope_trig._BLOCK + 123, generator=g, dtype=torch.float64) * 2.0**19
    whole = rope_trig._cos_sin_block(angles, 0.75)
    blocked = rope_trig.cos_sin(angles.view(-1, 1), 0.75)
    assert blocked[0].shape == (angles.numel(), 1)
    assert torch.equal(blocked[0].view(-1), whole[0]) and torch.equal(blocked[1].view(-1), whole[1])
