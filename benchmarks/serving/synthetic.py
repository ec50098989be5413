"""Synthetic serving fixtures for the device checks and benchmarks: a dummy-weight Llama model
directory and random peft LoRA adapters of that model's shapes.

vLLM serves the model with ``load_format="dummy"`` (only ``config.json`` is read), or from
random weights at a trained model's scale (:func:`write_random_weights`); the
adapters are real peft directories (``adapter_config.json`` + ``adapter_model.safetensors``)
with non-zero random A and B in bf16, so LoRA changes outputs. Where a text path needs a
tokenizer (``vllm serve`` and ``vllm bench serve``), :func:`write_word_tokenizer` gives the model
directory one whose token i is the word ``t<i>``. The model shapes (:data:`LLAMA32_3B`,
:data:`MISTRAL_7B`, :data:`LLAMA31_8B`) are those models' own ``config.json``.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serve_bridge.bundle import adapter_fingerprint

# Llama-3.2-3B's config.json with its llama3 rope scaling. transformers 5 folds rope_theta and
# rope_scaling into rope_parameters, and vLLM 0.26's llama loader hands those to get_rope
# (model_executor/models/llama.py:240-244; rope_type 'llama3' → Llama3RotaryEmbedding).
LLAMA32_3B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
}
# Mistral-7B-v0.3's config.json (vLLM 0.26 registers MistralForCausalLM in
# model_executor/models/registry.py:168, a LlamaForCausalLM subclass in mistral.py:230).
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 32768, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
    "sliding_window": None, "hidden_act": "silu", "attention_dropout": 0.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
# Llama-3.1-8B's config.json (the production-shaped table: rank-16 adapters, about 84 MB each).
LLAMA31_8B = {**LLAMA32_3B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "tie_word_embeddings": False}


def lora_targets(cfg: dict[str, Any]) -> dict[str, tuple[str, int, int]]:
    """peft target → (block, in features, out features) for a Llama config."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim", h // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"q_proj": ("self_attn", h, q), "k_proj": ("self_attn", h, kv), "v_proj": ("self_attn", h, kv),
            "o_proj": ("self_attn", q, h), "gate_proj": ("mlp", h, i), "up_proj": ("mlp", h, i),
            "down_proj": ("mlp", i, h)}


def write_model_config(work: Path, cfg: dict[str, Any]) -> Path:
    """``work/model/config.json``; returns the model directory."""
    d = work / "model"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


def write_word_tokenizer(model_dir: Path, cfg: dict[str, Any]) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` in ``model_dir``: a word-level tokenizer of
    ``cfg["vocab_size"]`` tokens, token i being the word ``t<i>``, split on whitespace, with the
    config's bos and eos ids as its special tokens and nothing added around a text.

    Decoding ids joins their words with single spaces (the tokenizer has no decoder) and encoding
    that text gives the same ids back, so a prompt of n random ids is a text of n tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    size = cfg["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": f"t{cfg['bos_token_id']}",
         "eos_token": f"t{cfg['eos_token_id']}", "clean_up_tokenization_spaces": False,
         "model_max_length": cfg["max_position_embeddings"]}))


def write_random_weights(work: Path, cfg: dict[str, Any], std: float = 0.02, seed: int = 0) -> Path:
    """``work/model/model.safetensors``: a Llama checkpoint of ``cfg``'s shapes with normal(0, ``std``)
    matrices and unit RMSNorm weights, in bf16 (embeddings tied when the config says so).

    vLLM's dummy weights are uniform in ±1e-3, norms included, so a dummy model's next token
    hardly depends on its context and small numeric differences in its attention or matmuls
    rarely change a token; at this scale they do, which is what a batch-invariance check needs."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).bfloat16()

    tensors = {"model.embed_tokens.weight": normal(v, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not cfg.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = normal(v, h)
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for mod, (block, n_in, n_out) in lora_targets(cfg).items():
            tensors[f"{prefix}.{block}.{mod}.weight"] = normal(n_out, n_in)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    path = work / "model" / "model.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def write_random_adapters(work: Path, cfg: dict[str, Any], n_adapters: int, rank: int, alpha: int,
                          name: Callable[[int], str], seed: int = 0, distinct: int | None = None) -> dict[int, str]:
    """Adapters ``work/adapters/<name(a)>`` for a = 0 … n−1 on q,k,v,o,gate,up,down; returns
    a → weights sha256. Weight file a < K (K = ``distinct``, default n) has entries uniform in
    ±(0.1 + 0.1·a/K); one seeded generator draws all of them in order, so the same arguments
    give the same bytes.

    ``distinct`` = K < n writes K weight files and hard-links adapter a's to file a mod K: every
    name is still its own peft directory, which vLLM loads and writes into a slot on its own,
    but only K × (one adapter's size) is written (1024 Llama-3B adapters at rank 8: 24 GB
    otherwise)."""
    import torch
    from safetensors.torch import save_file

    targets = lora_targets(cfg)
    g = torch.Generator().manual_seed(seed)
    k = n_adapters if distinct is None else max(1, min(distinct, n_adapters))
    fingerprints = {}
    for a in range(n_adapters):
        d = work / "adapters" / name(a)
        d.mkdir(parents=True, exist_ok=True)
        weights = d / "adapter_model.safetensors"
        if a < k:
            scale = 0.1 + 0.1 * a / k
            tensors = {}
            for layer in range(cfg["num_hidden_layers"]):
                for mod, (block, n_in, n_out) in targets.items():
                    key = f"base_model.model.model.layers.{layer}.{block}.{mod}"
                    tensors[f"{key}.lora_A.weight"] = ((torch.rand(rank, n_in, generator=g) * 2 - 1) * scale).bfloat16()
                    tensors[f"{key}.lora_B.weight"] = ((torch.rand(n_out, rank, generator=g) * 2 - 1) * scale).bfloat16()
            save_file(tensors, str(weights))
        else:
            weights.unlink(missing_ok=True)
            weights.hardlink_to(work / "adapters" / name(a % k) / "adapter_model.safetensors")
        (d / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "bias": "none",
             "target_modules": list(targets), "base_model_name_or_path": str(work / "model"),
             "modules_to_save": None, "use_rslora": False, "use_dora": False}))
        fingerprints[a] = fingerprints[a % k] if a >= k else adapter_fingerprint(d)
    return fingerprints
