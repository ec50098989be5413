"""labeling.engines.row_adapters against peft's own ``adapter_names`` on the embedded backbone with
two adapters: the same logits and hidden states, bit for bit, on fresh random batches."""
from __future__ import annotations

import random

import pytest
import torch

from labeling.engines.row_adapters import BASE


@pytest.mark.parametrize("seed", [0, 1])
def test_row_adapters_equal_peft_adapter_names(engine, seed: int) -> None:
    rng = random.Random(seed)
    names = [a.name for a in engine.adapters] + [BASE]
    rows = [rng.choice(names) for _ in range(5)]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, engine.tokenizer.vocab_size, (len(rows), 9), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "output_hidden_states": True}
    with torch.no_grad():
        want = engine.model(**inputs, adapter_names=rows)
        got = engine.forward(rows, **inputs)
        plain = engine.model(**inputs)  # after a call the hooks are inert: peft's active adapter again
        active = engine.model(**inputs, adapter_names=[engine.model.active_adapter] * len(rows))
    assert torch.equal(got.logits, want.logits)
    assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, want.hidden_states))
    assert torch.equal(plain.logits, active.logits)
    assert not torch.equal(engine.forward([BASE] * len(rows), **inputs).logits, active.logits)


def test_an_unknown_adapter_name_is_refused(engine) -> None:
    ids = torch.zeros((1, 2), dtype=torch.long)
    with pytest.raises(ValueError, match="no adapter named nope"):
        engine.forward(["nope"], input_ids=ids)
