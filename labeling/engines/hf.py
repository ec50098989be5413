"""Reference engine on transformers + peft: batched greedy generation with per-row adapters,
per-row release through the shared StepTrim code, hidden-state capture, and OFF branches
forked from the ON state by copying KV-cache rows.

Row model. A batch holds *rows*. Each request starts as one *main* row (slot = its adapter,
optionally driven by a StepTrim policy). After forward t a callback may *fork* an OFF
branch from a main row: the new row copies the main row's KV cache and tokens (the token
produced by forward t is shared) and runs without adapter from forward t+1 on — exactly
"profiled k = t" — so the prompt is never re-run per branch. Every row advances one token
per step, so all rows always share one cache length and forks are a row gather.

Shared prompt prefix. The leading prompt tokens that every request of one slot in a batch
shares (the chat template's system turn, a task's fixed instruction) run once per slot, and
each of those rows starts from a copy of that KV; only the rest of each prompt is prefilled
per row. A row's cache is [padding | shared prefix | padding | rest of its prompt], masked and
positioned as one contiguous prompt.

Hidden state h_t is the final-norm output at the position that produced token t+1
(captured with a forward hook on the backbone's final norm).
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from labeling.adapters import AdapterSpec, validate_adapter
from labeling.answer_cut import StopFn, cut_result, decided_at
from labeling.engines.batch_workers import map_batches
from labeling.engines.chat import ChatIO
from labeling.engines.cpu_matmul import CPU_MATMUL, use_bf16_matmuls
from labeling.engines.row_adapters import BASE, RowAdapters
from labeling.forks import ForkFn, forks_at
from labeling.options import CheckedOptions
from serve_bridge.steptrim import NO_SLOT, StepTrim

MIN_SHARED_PREFIX = 8  # prompt tokens a slot's requests must share before they are run once for all


@dataclass(frozen=True)
class GenRequest:
    """uid: request id; prompt_ids: tokenized prompt; slot: adapter index or NO_SLOT; stop: the
    task's answer-decided test on the response text (:mod:`labeling.answer_cut`; None: none)."""

    uid: str
    prompt_ids: list[int]
    slot: int
    stop: StopFn | None = field(default=None, compare=False, repr=False)


@dataclass
class GenResult:
    """One request's outcome.

    tokens: the main row's generated tokens (full LoRA, or policy-driven with ``steptrim``).
    release: realized release point r of the main row (None = never released).
    hidden: h_t for the captured forwards t (float32, [H]).
    scores: s_t at every forward of the main row (only when a scorer is given).
    branches: r -> the whole OFF_r response (shared prefix included).
    """

    uid: str
    slot: int
    tokens: list[int] = field(default_factory=list)
    release: int | None = None
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    scores: list[float] = field(default_factory=list)
    branches: dict[int, list[int]] = field(default_factory=dict)


def generated_tokens(res: GenResult) -> int:
    """Tokens an engine generated for ``res``: its ON response and its OFF branches past the
    prefix they share with it."""
    return len(res.tokens) + sum(len(b) - (t + 1) for t, b in res.branches.items())


@dataclass
class HFOptions(CheckedOptions):
    """``engine=hf``'s options: the device the model runs on (``cpu``, ``cuda``, ``cuda:1``...),
    requests per batch, processes that run batches side by side on the CPU (``auto``:
    :func:`labeling.engines.batch_workers.resolve_workers`), a progress bar per pass, and the dtype
    a float32 model multiplies in on the CPU (``cpu_matmul``: ``bfloat16`` rounds the linear layers'
    inputs and weights to bfloat16, :mod:`labeling.engines.cpu_matmul`; ``auto`` does so on a CPU
    with native bfloat16 dot products)."""

    rules = {"device": "text", "batch_size": "positive_int", "workers": "auto_or_positive_int",
             "cpu_matmul": CPU_MATMUL}

    name: str = "hf"
    device: str = "cpu"
    batch_size: int = 32
    workers: str = "auto"
    progress: bool = True
    cpu_matmul: str = "auto"


@dataclass
class _Row:
    req: int  # index into the batch's requests
    branch: int | None  # None = main row, else the fork's release point r
    release: int | None  # r once decided: forwards after r run without the adapter
    tokens: list[int]


class HFEngine(ChatIO):
    """Greedy multi-adapter generation on a transformers causal LM.

    ``adapters`` are loaded into one peft model as named adapters; a row's slot i uses
    ``adapters[i]`` until released, then the backbone alone. A row ends at any of
    ``stop_ids``, at ``max_new_tokens`` or where its request's answer is decided
    (:mod:`labeling.answer_cut`: with ``early_stop`` at that step, else its result is cut
    afterwards). Greedy decoding only (the exact one-pass sweep relies on it). With ``workers``
    > 1 a pass's batches run in that many processes forked from this one
    (:func:`labeling.engines.batch_workers.map_batches`): the same batches, so the same results.
    ``matmul="bfloat16"`` makes a float32 model's linear layers multiply in bfloat16
    (:mod:`labeling.engines.cpu_matmul`).
    """

    def __init__(self, model, tokenizer, adapters: Sequence[AdapterSpec], stop_ids: set[int],
                 batch_size: int = 32, progress: bool = True, early_stop: bool = True, workers: int = 1,
                 matmul: str = "float32") -> None:
        from peft import PeftModel

        hidden = model.config.hidden_size
        for spec in adapters:
            validate_adapter(spec, hidden)
        self.adapters = list(adapters)
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self.workers = int(workers)
        self.progress = progress
        self.early_stop = early_stop
        self.generated_tokens = 0  # tokens generated so far, before any cut (rows × steps)
        self.hidden_size = hidden
        self.eos_ids = set(stop_ids)
        if adapters:
            model = PeftModel.from_pretrained(model, adapters[0].path, adapter_name=adapters[0].name)
            for spec in adapters[1:]:
                model.load_adapter(spec.path, adapter_name=spec.name)
        self.model = model.eval()
        self._rows = RowAdapters(self.model) if adapters else None
        self.device = next(model.parameters()).device
        base = model.get_base_model() if adapters else model
        if matmul == "bfloat16" and next(base.parameters()).dtype == torch.float32:
            use_bf16_matmuls(base)
        self._norm = base.model.norm
        params = inspect.signature(base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def forward(self, names: Sequence[str], **inputs):
        """The model's forward with batch row i under adapter ``names[i]`` (BASE: none); without
        adapters, the backbone's (``names`` unused)."""
        return self._rows(names, **inputs) if self._rows is not None else self.model(**inputs)

    def generate(self, requests: Sequence[GenRequest], max_new_tokens: int, steptrim: StepTrim | None = None,
                 scorer: StepTrim | None = None, capture: Callable[[int], bool] | None = None,
                 fork: ForkFn | None = None, desc: str = "generate") -> list[GenResult]:
        """Generate for all requests in batches of ``batch_size`` (order preserved).

        steptrim: release policy driving main rows (None = full LoRA).
        scorer: StepTrim whose learned heads score main rows at every forward (s_t).
        capture(t): record h_t of main rows at forward t.
        fork(result, t, s_t): fork OFF_t from a main row after forward t (:mod:`labeling.forks`).
        With several workers, ``capture`` and ``fork`` run in the process that runs the request's
        batch: what they change outside the request's result is not seen here.
        Both StepTrims decide on the engine's device (a copy is made if needed), on that
        device's path: the same one the vLLM runtime takes there.
        """
        steptrim = steptrim.to(self.device) if steptrim is not None else None
        scorer = scorer.to(self.device) if scorer is not None else None
        for r in requests:
            if r.slot != NO_SLOT and not 0 <= r.slot < len(self.adapters):
                raise ValueError(f"request {r.uid}: slot {r.slot} has no adapter (have {len(self.adapters)})")
        batches = [list(requests[i:i + self.batch_size]) for i in range(0, len(requests), self.batch_size)]

        def run(b: int) -> tuple[list[GenResult], int]:
            done, generated = self._generate_batch(batches[b], max_new_tokens, steptrim, scorer, capture, fork)
            for r, res in zip(batches[b], done):
                cut_result(res, r.stop, self.decode)
            return done, generated

        results: list[list[GenResult]] = [[] for _ in batches]
        bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not self.progress)
        start, tokens = time.perf_counter(), 0
        for b, (done, generated) in map_batches(run, len(batches), self.workers):
            results[b] = done
            self.generated_tokens += generated
            tokens += sum(generated_tokens(r) for r in done)
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.0f} tokens/s", refresh=False)
            bar.update(len(done))
        bar.close()
        return [res for done in results for res in done]

    def _shared_prefixes(self, reqs: list[GenRequest]) -> tuple[list[int], list[dict[int, tuple[torch.Tensor, torch.Tensor]]]]:
        """Per request, how many leading prompt tokens it shares with every other request of its slot
        in the batch (0 if none, or if alone; always at least one token left to prefill), and per
        layer, slot → the (keys, values) of that shared prefix, run once with the slot's adapter."""
        from transformers import DynamicCache

        by_slot: dict[int, list[int]] = {}
        for j, r in enumerate(reqs):
            by_slot.setdefault(r.slot, []).append(j)
        shared = [0] * len(reqs)
        kv: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []
        for slot, members in by_slot.items():
            prompts = [reqs[j].prompt_ids for j in members]
            n = min(len(p) for p in prompts) - 1
            for i in range(n):
                if any(p[i] != prompts[0][i] for p in prompts[1:]):
                    n = i
                    break
            if len(members) < 2 or n < MIN_SHARED_PREFIX:
                continue
            ids = torch.tensor([prompts[0][:n]], device=self.device)
            cache = DynamicCache()
            self.forward([BASE if slot == NO_SLOT else self.adapters[slot].name], input_ids=ids,
                         attention_mask=torch.ones_like(ids), position_ids=torch.arange(n, device=self.device)[None],
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
            for layer, c in enumerate(cache.layers):
                if layer == len(kv):
                    kv.append({})
                kv[layer][slot] = (c.keys, c.values)
            for j in members:
                shared[j] = n
        return shared, kv

    @torch.no_grad()
    def _generate_batch(self, reqs: list[GenRequest], max_new: int, steptrim: StepTrim | None,
                        scorer: StepTrim | None, capture, fork) -> tuple[list[GenResult], int]:
        """The batch's results, and the tokens generated for it before any cut (rows × steps)."""
        from labeling.engines.kv_cache import row_cache, select_rows, stable_order

        dev = self.device
        pad = self.tokenizer.pad_token_id
        captured: dict[str, torch.Tensor] = {}
        hook = self._norm.register_forward_hook(lambda m, a, out: captured.__setitem__("h", out[:, -1]))
        try:
            # Prompt tokens that all requests of one slot share (chat template, task instruction) are
            # run once per slot; each row's cache starts with its slot's copy: [pad | shared | pad | rest].
            shared, kv = self._shared_prefixes(reqs)
            head = max(shared)
            rest = [r.prompt_ids[n:] for r, n in zip(reqs, shared)]
            width = max(len(x) for x in rest)
            ids = torch.full((len(reqs), width), pad, dtype=torch.long)
            mask = torch.zeros((len(reqs), head + width), dtype=torch.long)
            for j, (x, n) in enumerate(zip(rest, shared)):
                ids[j, width - len(x):] = torch.tensor(x)
                mask[j, head - n:head] = 1
                mask[j, head + width - len(x):] = 1
            ids, mask = ids.to(dev), mask.to(dev)
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, head:]
            cache = row_cache(length_hint=head + width + max_new)
            for layer, per_slot in enumerate(kv):
                k0, v0 = next(iter(per_slot.values()))
                keys = k0.new_zeros((len(reqs), k0.shape[1], head, k0.shape[3]))
                values = v0.new_zeros((len(reqs), v0.shape[1], head, v0.shape[3]))
                for j, r in enumerate(reqs):
                    if shared[j]:
                        keys[j, :, head - shared[j]:] = per_slot[r.slot][0][0]
                        values[j, :, head - shared[j]:] = per_slot[r.slot][1][0]
                cache.update(keys, values, layer)
            results = [GenResult(uid=r.uid, slot=r.slot) for r in reqs]
            rows = [_Row(req=j, branch=None, release=None, tokens=[]) for j in range(len(reqs))]
            t, generated = 0, 0
            while rows:
                names = [BASE if ((row.release is not None and t > row.release) or reqs[row.req].slot == NO_SLOT)
                         else self.adapters[reqs[row.req].slot].name for row in rows]
                out = self.forward(names, input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                                   logits_to_keep=1, **{self._cache_kw: cache})
                next_tok = out.logits[:, -1].argmax(-1)
                generated += len(rows)
                h = captured["h"].float()
                slots = torch.tensor([reqs[row.req].slot for row in rows], device=dev)
                tt = torch.full_like(slots, t)
                scores = scorer.scores(slots, h).tolist() if scorer is not None else None
                decided = (steptrim.step(slots, tt, torch.tensor([row.release is not None for row in rows], device=dev),
                                         h) if steptrim is not None else None)
                keep, forks = [], []
                for j, row in enumerate(rows):
                    tok = int(next_tok[j])
                    row.tokens.append(tok)
                    stop = reqs[row.req].stop if self.early_stop else None
                    done = (tok in self.eos_ids or len(row.tokens) >= max_new
                            or (stop is not None and decided_at(row.tokens, stop, self.decode)))
                    res = results[row.req]
                    if row.branch is None:
                        s = scores[j] if scores is not None else None
                        if s is not None:
                            res.scores.append(s)
                        if capture is not None and capture(t):
                            res.hidden[t] = h[j].cpu().clone()
                        if decided is not None and bool(decided[j]) and row.release is None:
                            row.release = res.release = steptrim.release_point(reqs[row.req].slot, t)
                        released = row.release is not None and row.release <= t
                        if fork is not None and forks_at(fork, res, t, s, released=released, last=done):
                            forks.append((j, _Row(req=row.req, branch=t, release=t, tokens=list(row.tokens))))
                    if done:
                        if row.branch is None:
                            res.tokens = row.tokens
                        else:
                            res.branches[row.branch] = row.tokens
                    else:
                        keep.append(j)
                order = stable_order(len(rows), keep)  # rows that stay keep their place in the cache
                rows_next = [rows[j] for j in order] + [f for _, f in forks]
                if not rows_next:
                    break
                if forks or len(keep) < len(rows):  # else every row goes on in place
                    index = torch.tensor(order + [j for j, _ in forks], device=dev)
                    select_rows(cache, index)
                    mask, positions = mask.index_select(0, index), positions.index_select(0, index)
                mask = torch.cat([mask, torch.ones((len(rows_next), 1), dtype=mask.dtype, device=dev)], 1)
                positions = positions[:, -1:] + 1
                ids = torch.tensor([[row.tokens[-1]] for row in rows_next], device=dev)
                rows = rows_next
                t += 1
        finally:
            hook.remove()
        return results, generated
