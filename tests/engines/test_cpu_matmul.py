"""bfloat16 multiplications for a float32 model on the CPU (labeling/engines/cpu_matmul.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from labeling.engines.cpu_matmul import NATIVE_BF16_FLAGS, cpu_flags, resolve_cpu_matmul, use_bf16_matmuls


def test_cpu_flags_reads_x86_flags_and_arm_features(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\nCPU implementer\t: 0x41\n")
    assert cpu_flags(x86) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(arm) == {"fp", "asimd", "bf16", "i8mm"}
    assert cpu_flags(tmp_path / "missing") == set()


@pytest.mark.parametrize(("option", "device", "dtype", "flags", "expected"), [
    ("auto", "cpu", "float32", {"avx2", "avx512_bf16"}, "bfloat16"),
    ("auto", "cpu", "float32", {"amx_bf16"}, "bfloat16"),
    ("auto", "cpu", "float32", {"avx2", "avx512f"}, "float32"),
    ("bfloat16", "cpu", "float32", set(), "bfloat16"),
    ("float32", "cpu", "float32", {"avx512_bf16"}, "float32"),
    ("auto", "cuda", "bfloat16", {"avx512_bf16"}, "bfloat16"),
    ("bfloat16", "cuda", "float32", set(), "float32"),
    ("auto", "cpu", "bfloat16", set(), "bfloat16"),
])
def test_resolve_cpu_matmul(option, device, dtype, flags, expected):
    assert resolve_cpu_matmul(option, device, dtype, flags) == expected


def test_resolve_refuses_an_unknown_option():
    with pytest.raises(ValueError, match="cpu_matmul must be one of auto, float32, bfloat16"):
        resolve_cpu_matmul("fp8", "cpu", "float32", set())


def _tiny_llama_with_lora():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(model, lora).eval()


def test_every_linear_multiplies_its_rounded_input_and_weight():
    """Each patched nn.Linear gives F.linear on bfloat16-rounded input and weight, as float32; the tied
    embedding stays float32 and is no longer the LM head's weight."""
    peft_model = _tiny_llama_with_lora()
    base = peft_model.get_base_model()
    linears = {name: m for name, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    weights = {name: m.weight.detach().clone() for name, m in linears.items()}
    assert base.lm_head.weight is base.model.embed_tokens.weight

    n = use_bf16_matmuls(base)

    assert n == len(linears) == 2 * 7 + 1 + 2 * 3 * 2  # 7 projections per layer, the head, A and B per target
    assert base.model.embed_tokens.weight.dtype == torch.float32
    assert base.lm_head.weight is not base.model.embed_tokens.weight
    g = torch.Generator().manual_seed(1)
    for name, m in linears.items():
        x = torch.randn(5, m.in_features, generator=g)
        want = F.linear(x.bfloat16(), weights[name].bfloat16()).float()
        got = m(x)
        assert got.dtype == torch.float32
        assert torch.equal(got, want), name
    assert use_bf16_matmuls(base) == 0  # a second call changes nothing


def test_the_patched_model_still_runs_and_follows_float32():
    """The whole model's logits stay within bfloat16 rounding of the float32 model's."""
    import copy

    peft_model = _tiny_llama_with_lora()
    reference = copy.deepcopy(peft_model)
    use_bf16_matmuls(peft_model.get_base_model())
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = peft_model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert got.dtype == torch.float32
    assert not torch.equal(got, want)
    assert torch.allclose(got, want, rtol=0.05, atol=0.05)


@pytest.mark.skipif(not cpu_flags() & NATIVE_BF16_FLAGS, reason="the CPU has no native bfloat16 dot products")
def test_a_rows_result_does_not_depend_on_the_other_rows():
    """What the module doc claims of this CPU's bfloat16 kernels (one torch thread): a row's output is the
    same alone, in a batch of any size, and at any position of it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer = torch.nn.Sequential(torch.nn.Linear(576, 1536, bias=False))
        assert use_bf16_matmuls(layer) == 1
        x = torch.randn(300, 576, generator=torch.Generator().manual_seed(3))
        full = layer(x)
        for rows in (slice(0, 1), slice(0, 3), slice(7, 71), slice(100, 300)):
            assert torch.equal(layer(x[rows]), full[rows]), rows
    finally:
        torch.set_num_threads(threads)
