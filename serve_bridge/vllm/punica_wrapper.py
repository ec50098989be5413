"""GridTrim in vLLM: a punica wrapper whose LoRA linears and logits run LoRazor's work-list kernels.

``add_lora_linear``, ``add_lora_logits``, ``add_shrink`` and ``add_expand`` keep
``PunicaWrapperGPU``'s signatures and contracts and launch only the row tiles of adapter rows, with
a grid that does not depend on the batch (one CUDA graph per batch size replays every adapter mix);
``update_metadata`` builds vLLM's metadata and the work lists on the host. Layers the kernels do
not support fall back to the stock methods, with one warning per reason. Selected by qualname when
``LORAZOR_GRIDTRIM`` is on (docs/vllm_integration.md §4-5).
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

from lora_kernels.worklist import persistent_programs
from serve_bridge import gridtrim
from serve_bridge.punica_meta import HostPunicaMetadata
from serve_bridge.vllm.settings import gridtrim_launch_from_env

QUALNAME = "serve_bridge.vllm.punica_wrapper.GridTrimPunicaWrapper"


class GridTrimPunicaWrapper(PunicaWrapperGPU):  # type: ignore[misc]  # @final is typing-only
    """``PunicaWrapperGPU`` with LoRA linears on LoRazor's work-list kernels (GridTrim)."""

    def __init__(self, max_num_batched_tokens: int, max_batches: int, device: torch.device | str,
                 **kwargs: Any) -> None:
        super().__init__(max_num_batched_tokens, max_batches, device, **kwargs)
        # Rebinds the metadata buffers PunicaWrapperGPU.__init__ just allocated to views of its upload
        # blocks, before anything captures them. Work lists:
        # the tokens' (token_mapping_meta) for the linears, the sampler's (prompt_mapping_meta) for the logits.
        self.gridtrim_meta = HostPunicaMetadata(self)
        self.gridtrim_worklist, self.gridtrim_prompt_worklist = self.gridtrim_meta.worklists
        self.gridtrim_programs = persistent_programs(device)
        self.gridtrim_launch = gridtrim_launch_from_env()
        gridtrim.logger.info("LoRazor GridTrim active: LoRA linears use the work-list kernels (%d tokens, "
                             "%d slots, %d persistent programs; compiled launches: %s).", max_num_batched_tokens,
                             self.max_loras + 1, self.gridtrim_programs, self.gridtrim_launch)

    def update_metadata(self, mapping: Any, lora_index_to_id: list[int | None], max_loras: int,
                        vocab_size: int, **kwargs: Any) -> None:
        # What PunicaWrapperGPU.update_metadata sets, the work lists included.
        self.is_prefill = mapping.is_prefill
        self.gridtrim_meta.update(mapping.index_mapping, mapping.prompt_mapping, lora_index_to_id, max_loras,
                                  vocab_size)

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                        lora_b_stacked: tuple[torch.Tensor, ...], scale: float, output_slices: tuple[int, ...],
                        *, buffer: torch.Tensor | None = None, **kwargs: Any) -> None:
        """Same signature and semantics as ``PunicaWrapperGPU.add_lora_linear``: ``y`` is updated in
        place; ``add_inputs`` (default True) and ``offset_start`` (default 0) come through ``kwargs``."""
        assert len(lora_a_stacked) == len(lora_b_stacked) == len(output_slices)
        assert buffer is None, "the buffer is created inside add_lora_linear, as in the stock method"
        add_inputs = kwargs.get("add_inputs", True)
        offset_start = kwargs.get("offset_start", 0)
        # Same metadata views as the stock add_shrink/add_expand.
        meta_args = self.token_mapping_meta.meta_args(x.size(0), self.lora_config.specialize_active_lora)
        done = gridtrim.add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, meta_args,
                                        self.gridtrim_worklist, offset_start=offset_start, add_inputs=add_inputs,
                                        num_programs=self.gridtrim_programs, compiled_launch=self.gridtrim_launch)
        if not done:
            super().add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, **kwargs)

    def add_lora_logits(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor,
                        lora_b_stacked: torch.Tensor, scale: float, *, buffer: torch.Tensor | None = None,
                        **kwargs: Any) -> None:
        """Same contract as ``PunicaWrapperGPU.add_lora_logits``:
        ``y[:, :V] += bf(scale · x @ A[id]ᵀ) @ B[id]ᵀ`` for the sampled rows with an adapter, V the
        LoRA vocabulary (``lora_b_stacked``'s rows; ``y`` may be wider), ids from the sampler's
        mapping. Layers our kernels cannot run (e.g. fp32 logits) take the stock method."""
        assert buffer is None, "the buffer is created inside add_lora_logits, as in the stock method"
        y2, x2 = gridtrim.as_rows(y), gridtrim.as_rows(x)
        meta_args = self.prompt_mapping_meta.meta_args(x2.size(0), self.lora_config.specialize_active_lora)
        done = gridtrim.add_lora_linear(y2, x2, (lora_a_stacked,), (lora_b_stacked,), scale,
                                        (lora_b_stacked.shape[-2],), meta_args, self.gridtrim_prompt_worklist,
                                        num_programs=self.gridtrim_programs, compiled_launch=self.gridtrim_launch)
        if not done:
            super().add_lora_logits(y, x, lora_a_stacked, lora_b_stacked, scale, **kwargs)

    def add_shrink(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...], scale: float,
                   **kwargs: Any) -> None:
        """Same contract as ``PunicaWrapperGPU.add_shrink``: ``y`` (vLLM's fp32 ``[slices, M, rank]``
        buffer) = ``scale · x @ A_s[id]ᵀ`` on rows with an adapter, 0 on the others. Returns None, as
        the stock method does on CUDA."""
        x2 = gridtrim.as_rows(x)
        # The stock method's metadata view; self.gridtrim_worklist was uploaded with the same
        # token_mapping_meta in update_metadata.
        meta_args = self.token_mapping_meta.meta_args(x2.size(0), self.lora_config.specialize_active_lora)
        if not gridtrim.shrink(y, x2, lora_a_stacked, scale, meta_args, self.gridtrim_worklist,
                               num_programs=self.gridtrim_programs, compiled_launch=self.gridtrim_launch):
            super().add_shrink(y, x, lora_a_stacked, scale, **kwargs)

    def add_expand(self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked: tuple[torch.Tensor, ...],
                   output_slices: tuple[int, ...], offset_start: int = 0, add_inputs: bool = True,
                   **kwargs: Any) -> None:
        """Same contract as ``PunicaWrapperGPU.add_expand``: ``x`` the fp32 ``[slices, M, rank]``
        buffer, ``y[:, offset_start + …]`` (+)= ``bf(x[s]) @ B_s[id]ᵀ`` per slice on rows with an
        adapter. The fully-sharded layers' ``add_input=True`` (sic) lands in ``kwargs``."""
        y2 = gridtrim.as_rows(y)
        # num_tokens is the buffer's second dimension, as in the stock method.
        meta_args = self.token_mapping_meta.meta_args(x.size(1), self.lora_config.specialize_active_lora)
        if not gridtrim.expand(y2, x, lora_b_stacked, output_slices, meta_args, self.gridtrim_worklist,
                               offset_start=offset_start, add_inputs=add_inputs,
                               num_programs=self.gridtrim_programs, compiled_launch=self.gridtrim_launch):
            super().add_expand(y, x, lora_b_stacked, output_slices, offset_start, add_inputs, **kwargs)
