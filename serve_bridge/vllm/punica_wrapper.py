"""GridTrim's vLLM 0.26.0 hook: a punica wrapper whose LoRA linears run our work-list kernels.

Imported only when ``LORAZOR_GRIDTRIM`` is on, by vLLM itself: :func:`serve_bridge.vllm.plugin.register`
makes ``current_platform.get_punica_wrapper()`` return :data:`QUALNAME`, and the selector
(``lora/punica_wrapper/punica_selector.py:13-16``) resolves that qualname and builds the class
with ``(max_num_batched_tokens, max_batches=..., device=..., lora_config=...)``
(``lora/model_manager.py:168-173``). Paths are inside the ``vllm`` package, 0.26.0.

What it changes, and what it leaves stock:

- ``add_lora_linear`` (``lora/punica_wrapper/punica_gpu.py:203-264``): every linear LoRA
  layer calls it, from ``lora/layers/base_linear.py:227`` (in place) and ``:269`` (dual-stream
  path, ``add_inputs=False`` into a zeroed buffer). Ours runs :func:`serve_bridge.gridtrim.
  add_lora_linear`: shrink + expand over the device-built list of useful row tiles, with a grid
  that does not depend on the batch. It never returns early on a host-side flag (the stock ops
  do, on ``no_lora_flag_cpu``, ``lora/ops/triton_ops/lora_shrink_op.py:171-174``): CUDA graphs
  are captured through this call, and a step with no adapter rows replays it as a device-side
  no-op (``num_tiles = 0``). Layers our kernels do not support (dtype, >3 slices, rank > 64,
  unequal A shapes) fall back to the stock method, with one warning per reason.
- ``update_metadata`` (``punica_gpu.py:75-88``): once per step, eagerly, before the forward
  (and before any CUDA graph replay). vLLM's version loops over every token in Python and then
  prepares its kernel metadata with small device ops and host syncs. Ours
  (:class:`serve_bridge.punica_meta.HostPunicaMetadata`) writes the same values, and both work
  lists, with numpy on the host, then uploads them in two copies into device blocks. vLLM's buffers
  are views of those blocks from construction on.
- ``add_lora_logits`` (``punica_gpu.py:266-325``, called from ``lora/layers/logits_processor.py:185``
  on every step, eagerly, for the sampled rows): vLLM wraps ``lm_head`` in a LoRA layer whatever
  the adapters target (``lora/utils.py:219-238`` adds the model's ``embedding_modules``), so the
  stock path runs a shrink and a vocabulary-wide expand (128256 columns for Llama-3) over every
  adapter slot each step. It is a one-slice LoRA linear over the sampler's mapping
  (``prompt_mapping_meta``), so ours runs it on the same kernels with the sampler's work list,
  uploaded by ``update_metadata``.
- ``add_shrink`` / ``add_expand`` (``punica_gpu.py:90-169``): called directly only by the
  fully-sharded tensor-parallel paths (``fully_sharded_loras``), which communicate between them
  (``lora/layers/column_parallel_linear.py:57-73``: all-gather of the buffer;
  ``row_parallel_linear.py:129-153``: all-reduce), and by the stock ``add_lora_linear`` that a
  fallback runs (``punica_gpu.py:250-264``). Ours run :func:`serve_bridge.gridtrim.shrink` /
  :func:`~serve_bridge.gridtrim.expand` on the same work list, through vLLM's fp32
  ``[slices, M, rank]`` buffer; ineligible calls take the stock methods, one warning per reason.
  The default (not fully-sharded) TP paths only call ``add_lora_linear``, with sharded weights
  (see :mod:`serve_bridge.gridtrim`).
- Stock: ``add_lora_embedding`` (``lora/layers/vocal_parallel_embedding.py:119``) and the MoE
  paths keep vLLM's kernels.

Our kernels ignore ``num_active_loras``, so the adapter-count CUDA-graph specialization
(``specialize_active_lora``) buys nothing here: with it off, each batch size has one LoRA graph
(``v1/cudagraph_dispatcher.py:111-130``, ``lora/utils.py:49-64``).

``PunicaWrapperGPU`` is decorated ``typing.final`` (``punica_gpu.py:32``); that is a type-checker
hint only, and subclassing works at runtime.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

from kernels.worklist import persistent_programs
from serve_bridge import gridtrim
from serve_bridge.punica_meta import HostPunicaMetadata

QUALNAME = "serve_bridge.vllm.punica_wrapper.GridTrimPunicaWrapper"


class GridTrimPunicaWrapper(PunicaWrapperGPU):  # type: ignore[misc]  # @final is typing-only
    """``PunicaWrapperGPU`` with LoRA linears on LoRazor's work-list kernels (GridTrim)."""

    def __init__(self, max_num_batched_tokens: int, max_batches: int, device: torch.device | str,
                 **kwargs: Any) -> None:
        super().__init__(max_num_batched_tokens, max_batches, device, **kwargs)
        # Rebinds the metadata buffers PunicaWrapperGPU.__init__ just allocated (punica_base.py:138-150,
        # punica_gpu.py:55-73) to views of its upload blocks, before anything captures them. Work lists:
        # the tokens' (token_mapping_meta) for the linears, the sampler's (prompt_mapping_meta) for the logits.
        self.gridtrim_meta = HostPunicaMetadata(self)
        self.gridtrim_worklist, self.gridtrim_prompt_worklist = self.gridtrim_meta.worklists
        # One-slice tuples of the logits layer's stacks, kept so gridtrim's per-layer eligibility
        # cache (keyed by the tuples' identity) sees the same objects every step.
        self._gridtrim_logits_stacks: tuple[tuple[torch.Tensor], tuple[torch.Tensor]] | None = None
        self.gridtrim_programs = persistent_programs(device)
        gridtrim.logger.info("LoRazor GridTrim active: LoRA linears use the work-list kernels (%d tokens, "
                             "%d slots, %d persistent programs).", max_num_batched_tokens, self.max_loras + 1,
                             self.gridtrim_programs)

    def update_metadata(self, mapping: Any, lora_index_to_id: list[int | None], max_loras: int,
                        vocab_size: int, **kwargs: Any) -> None:
        # What PunicaWrapperGPU.update_metadata sets (punica_gpu.py:84-88), the work lists included.
        self.is_prefill = mapping.is_prefill
        self.gridtrim_meta.update(mapping.index_mapping, mapping.prompt_mapping, lora_index_to_id, max_loras,
                                  vocab_size)

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                        lora_b_stacked: tuple[torch.Tensor, ...], scale: float, output_slices: tuple[int, ...],
                        *, buffer: torch.Tensor | None = None, **kwargs: Any) -> None:
        """Same signature and semantics as ``PunicaWrapperGPU.add_lora_linear`` (punica_gpu.py:203-264):
        ``y`` is updated in place; ``add_inputs`` (default True) and ``offset_start`` (default 0, which
        the stock method forwards to ``add_expand``, :123-131) come through ``kwargs``."""
        assert len(lora_a_stacked) == len(lora_b_stacked) == len(output_slices)
        assert buffer is None, "the buffer is created inside add_lora_linear (as in punica_gpu.py:238-241)"
        add_inputs = kwargs.get("add_inputs", True)
        offset_start = kwargs.get("offset_start", 0)
        # Same metadata views as the stock add_shrink/add_expand (punica_gpu.py:117-119, 162-164).
        meta_args = self.token_mapping_meta.meta_args(x.size(0), self.lora_config.specialize_active_lora)
        done = gridtrim.add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, meta_args,
                                        self.gridtrim_worklist, offset_start=offset_start, add_inputs=add_inputs,
                                        num_programs=self.gridtrim_programs)
        if not done:
            super().add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, **kwargs)

    def add_lora_logits(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor,
                        lora_b_stacked: torch.Tensor, scale: float, *, buffer: torch.Tensor | None = None,
                        **kwargs: Any) -> None:
        """Same contract as ``PunicaWrapperGPU.add_lora_logits`` (punica_gpu.py:266-325):
        ``y[:, :V] += bf(scale · x @ A[id]ᵀ) @ B[id]ᵀ`` for the sampled rows with an adapter, V the
        LoRA vocabulary (``lora_b_stacked``'s rows; ``y`` may be wider), ids from the sampler's
        mapping. Layers our kernels cannot run (e.g. fp32 logits) take the stock method."""
        assert buffer is None, "the buffer is created inside add_lora_logits (as in punica_gpu.py:297-304)"
        y2, x2 = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1])
        meta_args = self.prompt_mapping_meta.meta_args(x2.size(0), self.lora_config.specialize_active_lora)
        stacks = self._gridtrim_logits_stacks
        if stacks is None or stacks[0][0] is not lora_a_stacked or stacks[1][0] is not lora_b_stacked:
            stacks = self._gridtrim_logits_stacks = ((lora_a_stacked,), (lora_b_stacked,))
        done = gridtrim.add_lora_linear(y2, x2, stacks[0], stacks[1], scale, (lora_b_stacked.shape[-2],), meta_args,
                                        self.gridtrim_prompt_worklist, num_programs=self.gridtrim_programs)
        if not done:
            super().add_lora_logits(y, x, lora_a_stacked, lora_b_stacked, scale, **kwargs)

    def add_shrink(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...], scale: float,
                   **kwargs: Any) -> None:
        """Same contract as ``PunicaWrapperGPU.add_shrink`` (punica_gpu.py:90-121): ``y`` (vLLM's fp32
        ``[slices, M, rank]`` buffer) = ``scale · x @ A_s[id]ᵀ`` on rows with an adapter, 0 on the others
        (the stock op zeroes it first, lora_shrink_op.py:192). Returns None, as the stock method does
        (the callers use the return value only where ``can_update_inplace()`` is False, not on CUDA)."""
        x2 = x.view(-1, x.shape[-1])
        # The stock method's metadata view (punica_gpu.py:113-120); self.gridtrim_worklist was uploaded
        # with the same token_mapping_meta in update_metadata.
        meta_args = self.token_mapping_meta.meta_args(x2.size(0), self.lora_config.specialize_active_lora)
        if not gridtrim.shrink(y, x2, lora_a_stacked, scale, meta_args, self.gridtrim_worklist,
                               num_programs=self.gridtrim_programs):
            super().add_shrink(y, x, lora_a_stacked, scale, **kwargs)

    def add_expand(self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked: tuple[torch.Tensor, ...],
                   output_slices: tuple[int, ...], offset_start: int = 0, add_inputs: bool = True,
                   **kwargs: Any) -> None:
        """Same contract as ``PunicaWrapperGPU.add_expand`` (punica_gpu.py:123-169): ``x`` the fp32
        ``[slices, M, rank]`` buffer, ``y[:, offset_start + …]`` (+)= ``bf(x[s]) @ B_s[id]ᵀ`` per slice
        on rows with an adapter. The fully-sharded layers pass ``add_input=True`` (sic,
        column_parallel_linear.py:72, row_parallel_linear.py:152), which lands in ``kwargs`` and
        leaves ``add_inputs`` at its default True, as in the stock method."""
        y2 = y.view(-1, y.shape[-1])
        # num_tokens is the buffer's second dimension, as in punica_gpu.py:156-164.
        meta_args = self.token_mapping_meta.meta_args(x.size(1), self.lora_config.specialize_active_lora)
        if not gridtrim.expand(y2, x, lora_b_stacked, output_slices, meta_args, self.gridtrim_worklist,
                               offset_start=offset_start, add_inputs=add_inputs,
                               num_programs=self.gridtrim_programs):
            super().add_expand(y, x, lora_b_stacked, output_slices, offset_start, add_inputs, **kwargs)
