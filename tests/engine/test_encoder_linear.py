"""engine/encoder_linear.py's GELU fusion: which transformers activations oneDNN computes, and a SigLIP vision
tower fused against transformers' own layers."""

from __future__ import annotations

import pytest
import torch
from helpers import fresh_seed
from sluice.engine.encoder_linear import fuse_gelu, gelu_approximation
from sluice.engine.linear import onednn_supports
from transformers.activations import ACT2FN, GELUTanh


def test_only_the_gelus_onednn_computes_are_fused() -> None:
    assert gelu_approximation(ACT2FN["gelu"]) == "none"
    assert gelu_approximation(ACT2FN["gelu_pytorch_tanh"]) == "tanh"
    for other in (GELUTanh(use_gelu_tanh_python=True), ACT2FN["gelu_new"], ACT2FN["quick_gelu"], ACT2FN["silu"], None):
        assert gelu_approximation(other) is None, other


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_siglip_tower_fused_matches_transformers(dtype: torch.dtype) -> None:
    if not onednn_supports(dtype):
        pytest.skip(f"oneDNN does not run {dtype} on this CPU")
    from transformers import SiglipVisionConfig, SiglipVisionModel

    seed = fresh_seed()
    torch.manual_seed(seed)
    cfg = SiglipVisionConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                             image_size=64, patch_size=16, vision_use_head=False)  # gelu_pytorch_tanh, as SmolVLM's; no pooling head, as Idefics3's tower
    ref = SiglipVisionModel(cfg).to(dtype).eval()
    fused = SiglipVisionModel(cfg).to(dtype).eval()
    fused.load_state_dict(ref.state_dict())
    assert fuse_gelu(fused) == cfg.num_hidden_layers
    assert all(type(m.fc1).__name__ == "PackedDenseGelu" for m in fused.modules() if hasattr(m, "fc1"))
    x = torch.randn(2, 3, 64, 64).to(dtype)
    with torch.inference_mode():
        want, got = ref(pixel_values=x).last_hidden_state.float(), fused(pixel_values=x).last_hidden_state.float()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(got, want, atol=tol, rtol=tol), f"seed {seed}: max diff {(got - want).abs().max():.3g}"
