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
    exact = SiglipVisionModel(cfg).eval()  # float32, transformers' own layers
    ref = SiglipVisionModel(cfg).eval()
    ref.load_state_dict(exact.state_dict())
    ref = ref.to(dtype)
    fused = SiglipVisionModel(cfg).eval()
    fused.load_state_dict(exact.state_dict())
    fused = fused.to(dtype)
    assert fuse_gelu(fused) == cfg.num_hidden_layers
    assert all(type(m.fc1).__name__ == "PackedDenseGelu" for m in fused.modules() if hasattr(m, "fc1"))
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        want = exact(pixel_values=x).last_hidden_state
        ours = ref(pixel_values=x.to(dtype)).last_hidden_state.float()
        got = fused(pixel_values=x.to(dtype)).last_hidden_state.float()
    if dtype == torch.float32:
        assert torch.allclose(got, ours, atol=1e-4, rtol=1e-4), f"seed {seed}: max diff {(got - ours).abs().max():.3g}"
    else:  # both round differently in bfloat16 (up to 0.06 apart over 30 seeds): each against float32 instead
        err, ref_err = (got - want).abs().max().item(), (ours - want).abs().max().item()
        assert err <= 2 * ref_err + 1e-2, f"seed {seed}: fused {err:.3g} vs transformers' {ref_err:.3g} from float32"
