"""The fused RMSNorm (+ residual), rotary and SiLU * up kernels, the Triton ones under the interpreter and
the C++ CPU ops, against the model's own PyTorch formulas (engine/models/llama.py). Fresh random inputs
each run from a printed seed."""

from __future__ import annotations

import random
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from helpers import fresh_seed
from sluice.kernels import cpu_fused, fused
from sluice.kernels.reference import relative_error

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
KERNELS = [pytest.param(fused, id="triton"), pytest.param(cpu_fused, id="cpp")]
# The interpreter gets bfloat16 arithmetic wrong; the C++ ops are checked in it too.
DTYPES = [pytest.param(k, d, id=f"{name}-{str(d)[6:]}") for k, name in ((fused, "triton"), (cpu_fused, "cpp"))
          for d in (torch.float32, torch.float16)] + [pytest.param(cpu_fused, torch.bfloat16, id="cpp-bfloat16")]


@pytest.fixture
def rng() -> random.Random:
    seed = fresh_seed()
    torch.manual_seed(seed)
    return random.Random(seed)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotary_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The model's rotation in float64, from the tables as the model casts them (to the activation dtype)."""
    c = cos[positions].to(x.dtype).double()[:, None, :]
    s = sin[positions].to(x.dtype).double()[:, None, :]
    xd = x.double()
    half = x.shape[-1] // 2
    rotated = torch.cat((-xd[..., half:], xd[..., :half]), dim=-1)
    return xd * c + rotated * s


@pytest.mark.parametrize("kernels,dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 2048])
def test_rms_norm(rng: random.Random, kernels: ModuleType, dtype: torch.dtype, hidden: int) -> None:
    tokens = rng.randint(1, 40)
    x = (torch.randn(tokens, hidden) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    out = kernels.rms_norm(x, weight, 1e-5)
    err = relative_error(out, torch_rms_norm(x, weight, 1e-5).double())
    assert err <= TOL[dtype], err


@pytest.mark.parametrize("kernels,dtype", DTYPES)
def test_rms_norm_with_residual(rng: random.Random, kernels: ModuleType, dtype: torch.dtype) -> None:
    tokens, hidden = rng.randint(1, 40), rng.choice([576, 2048])
    x = torch.randn(tokens, hidden).to(dtype)
    residual = (torch.randn(tokens, hidden) * 4).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    out, h = kernels.rms_norm(x, weight, 1e-6, residual=residual)
    assert torch.equal(h, residual + x)  # the residual stream, rounded as the unfused add rounds it
    err = relative_error(out, torch_rms_norm(residual + x, weight, 1e-6).double())
    assert err <= TOL[dtype], err


@pytest.mark.parametrize("kernels,dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 64), (8, 1, 128)])
def test_rotary(rng: random.Random, kernels: ModuleType, dtype: torch.dtype, hq: int, hkv: int, d: int) -> None:
    tokens, max_pos = rng.randint(1, 30), 4096
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = torch.arange(max_pos, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    positions = torch.tensor([rng.randrange(max_pos) for _ in range(tokens)])
    # q and k as strided views into one fused projection, as the model has them.
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d).to(dtype)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    ref_q = rotary_reference(q, cos, sin, positions)
    ref_k = rotary_reference(k, cos, sin, positions)
    eager = qkv[:, : (hq + hkv) * d].view(tokens, hq + hkv, d)
    half = d // 2
    sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    eager = (eager * cos[positions].to(dtype)[:, None] + eager.roll(half, dims=-1) * sin_signed[positions].to(dtype)[:, None])
    out_q, out_k = kernels.apply_rotary(positions, q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    assert relative_error(q, ref_q) <= TOL[dtype]
    assert relative_error(k, ref_k) <= TOL[dtype]
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # v untouched
    if kernels is cpu_fused:  # rounds where the eager model rounds: the same bits
        assert torch.equal(torch.cat((q, k), dim=1), eager)


def test_cpp_rotary_rejects_a_position_outside_its_tables() -> None:
    cos = sin = torch.zeros(8, 64)
    q, k = torch.zeros(2, 4, 64), torch.zeros(2, 1, 64)
    with pytest.raises(RuntimeError, match="position 8 is outside the rotary tables"):
        cpu_fused.apply_rotary(torch.tensor([0, 8]), q, k, cos, sin)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's exp(100): inf, as on a GPU
@pytest.mark.parametrize("kernels,dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [128, 1536, 1000])
def test_silu_and_mul(rng: random.Random, kernels: ModuleType, dtype: torch.dtype, intermediate: int) -> None:
    tokens = rng.randint(1, 40)
    gate_up = (torch.randn(tokens, 2 * intermediate) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's range ends and zero
    gate, up = gate_up.split(intermediate, dim=-1)
    out = kernels.silu_and_mul(gate_up)
    assert out.shape == (tokens, intermediate) and out.dtype == dtype
    ref = F.silu(gate.double()).to(dtype).double() * up.double()
    assert relative_error(out, ref) <= TOL[dtype]
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kernels,mlp_passes", [pytest.param(fused, False, id="triton"), pytest.param(cpu_fused, False, id="cpp"),
                                                pytest.param(cpu_fused, True, id="cpp-passes")])
def test_model_with_fused_kernels_matches_eager(rng: random.Random, kernels: ModuleType, mlp_passes: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's switch to the fused kernels (Triton's with Triton attention on CUDA, the C++ ops with
    the C++ attention op): a packed step of prompt chunks through the whole tiny model gives the eager
    model's hidden states; also with the C++ path's MLP in passes of a few rows (as a long step runs it)."""
    from sluice.engine.models import llama
    from transformers import LlamaConfig

    if mlp_passes:
        monkeypatch.setattr(llama, "MLP_MIN_ROWS", 1)
        monkeypatch.setattr(cpu_fused, "MLP_BLOCK_BYTES", rng.randint(3, 20) * 2 * 128 * 4)

    from sluice.engine.config import EngineConfig
    from sluice.engine.model_runner import ModelRunner
    from sluice.engine.models.llama import LlamaForCausalLM
    from sluice.engine.sampling_params import SamplingParams
    from sluice.engine.scheduler import ScheduledBatch
    from sluice.engine.sequence import Sequence

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg, 128).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    runner = ModelRunner(EngineConfig(block_size=16, attention_backend="torch"), model, torch.device("cpu"),
                         torch.float32, 128)
    assert model.rotary.kernels is None and model.norm.kernels is None  # eager beside the PyTorch fallback
    lens = [rng.randint(1, 40) for _ in range(3)]
    batch, start = ScheduledBatch(), 0
    for i, n in enumerate(lens):
        seq = Sequence(i, f"r{i}", 0, [rng.randrange(300) for _ in range(n)], n, SamplingParams())
        seq.block_table = list(range(start, start + -(-n // 16)))
        start += len(seq.block_table)
        batch.add(seq, n)
    runner._allocate(start)
    runner.zero_fresh_blocks(start)
    ids, pos, meta, _, _ = runner.prepare(batch)
    with torch.inference_mode():
        eager = model(ids, pos, runner.kv_caches, meta, runner.backend)
        model.use_fused_kernels(kernels)
        assert model.rotary.kernels is kernels and model.norm.kernels is kernels
        assert model.layers[0].mlp.kernels is kernels
        out = model(ids, pos, runner.kv_caches, meta, runner.backend)
    assert relative_error(out, eager.double()) <= 1e-5


def test_the_cpp_attention_op_brings_the_cpp_fused_kernels() -> None:
    from sluice.engine.config import EngineConfig
    from sluice.engine.model_runner import elementwise_kernels, make_backend

    cpu = torch.device("cpu")
    assert elementwise_kernels(make_backend(EngineConfig(attention_backend="cpu"), cpu), cpu) is cpu_fused
    assert elementwise_kernels(make_backend(EngineConfig(attention_backend="torch"), cpu), cpu) is None
    # Triton's kernels only on CUDA: interpreted on a CPU they would be slower than eager.
    assert elementwise_kernels(make_backend(EngineConfig(attention_backend="triton"), cpu), cpu) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mlp_in_passes_of_rows_matches_it_whole(rng: random.Random, monkeypatch: pytest.MonkeyPatch,
                                                    dtype: torch.dtype) -> None:
    """A long step's MLP runs in passes of rows (its intermediate kept in cache): the same rows, in
    order, as one pass on both GEMM paths; and one pass under a LoRA hook, which indexes the step's rows."""
    from sluice.engine.linear import make_linear
    from sluice.engine.models import llama

    hidden, inter, rows = 48, 80, rng.randint(40, 300)
    mlp = llama.MLP(hidden, inter, bias=rng.random() < 0.5).to(dtype)
    x = torch.randn(rows, hidden).to(dtype)
    with torch.inference_mode():
        whole = mlp.down_proj(cpu_fused.silu_and_mul(mlp.gate_up_proj(x)))
        mlp.kernels = cpu_fused
        assert mlp._block_rows(x) >= rows  # the real budget: a small step runs in one pass
        per_pass = rng.randint(3, 37)
        monkeypatch.setattr(llama, "MLP_MIN_ROWS", 1)
        monkeypatch.setattr(cpu_fused, "MLP_BLOCK_BYTES", per_pass * 2 * inter * x.element_size())
        assert mlp._block_rows(x) == per_pass
        calls: list[int] = []
        hook = mlp.down_proj.register_forward_hook(lambda m, args, out: calls.append(out.shape[0]))
        assert torch.equal(mlp(x), whole) and calls == [rows], "a hooked layer must see the step's rows at once"
        hook.remove()
        for impl in ("aten", "onednn-packed"):
            if impl == "onednn-packed" and (dtype != torch.float32 or not torch.backends.mkldnn.is_available()):
                continue
            mlp.gate_up_proj, mlp.down_proj = (make_linear(impl, lin) for lin in (mlp.gate_up_proj, mlp.down_proj))
            out = mlp(x)
            assert out.shape == whole.shape
            assert relative_error(out, whole.double()) <= TOL[dtype], impl
