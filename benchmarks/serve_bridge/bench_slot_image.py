"""Host time of an adapter's slot image: rendering it (:meth:`serve_bridge.slot_copy.SlotWriter.image`,
once per adapter loaded: ``vllm serve --lora-modules`` loads every adapter at start-up) and writing it
into a slot (:meth:`~serve_bridge.slot_copy.SlotWriter.write`, once per slot load). No vLLM, no GPU.

    python -m benchmarks.serve_bridge.bench_slot_image [--layers 28] [--rank 8] [--adapters 16] [--out FILE]

The layers are Llama-3.2-3B's four LoRA linears per layer (qkv, o, gate_up, down; bf16) as
:class:`StackedLinear`, vLLM's stacked slot tensors with its ``reset_lora``/``set_lora`` restated
(``lora/layers/base_linear.py:153-184``, ``column_parallel_linear.py:302-328`` in 0.26.0; the same
in 0.33.0), two slots, and one random adapter of ``--rank`` on every slice. On the CPU the image
is not pinned (pinning needs CUDA) and the write's copies are host copies. As at a server's
start-up, ``--adapters`` images are rendered one after another and all kept (each in memory of its
own), then each is written into a slot. Reports the median per image, in ms, and its size.
"""
from __future__ import annotations

import datetime as dt
import platform
import statistics
import time
from typing import Any

import torch

from benchmarks.printed import Printed, add_out_options, check_out
from serve_bridge.command_line import Parser, number
from serve_bridge.slot_copy import SlotWriter

# Llama-3.2-3B: hidden 3072, 8 KV heads of 128, intermediate 8192
SHAPES = {"qkv": (3072, [3072, 1024, 1024]), "o": (3072, [3072]), "gate_up": (3072, [8192, 8192]),
          "down": (8192, [3072])}


class StackedLinear:
    """A linear LoRA layer of ``outputs`` slices as vLLM stacks it: ``lora_a_stacked`` tuples of
    [slots, 1, rank, inputs], ``lora_b_stacked`` of [slots, 1, out, rank]."""

    def __init__(self, inputs: int, outputs: list[int], slots: int, rank: int,
                 dtype: torch.dtype = torch.float32) -> None:
        self.lora_a_stacked = tuple(torch.zeros(slots, 1, rank, inputs, dtype=dtype) for _ in outputs)
        self.lora_b_stacked = tuple(torch.zeros(slots, 1, out, rank, dtype=dtype) for out in outputs)

    def reset_lora(self, index: int) -> None:
        for a, b in zip(self.lora_a_stacked, self.lora_b_stacked):
            a[index] = 0
            b[index] = 0

    def set_lora(self, index: int, lora_a: list, lora_b: list) -> None:
        self.reset_lora(index)
        for i, (a, b) in enumerate(zip(lora_a, lora_b)):
            if a is not None:
                self.lora_a_stacked[i][index, 0, :a.shape[0], :a.shape[1]].copy_(a, non_blocking=True)
            if b is not None:
                self.lora_b_stacked[i][index, 0, :b.shape[0], :b.shape[1]].copy_(b, non_blocking=True)


def model(layers: int, rank: int) -> tuple[dict[str, StackedLinear], dict[str, Any]]:
    """The layers and one random adapter of ``rank`` on every slice (module doc)."""
    g = torch.Generator().manual_seed(0)
    mods = {f"{i}.{name}": StackedLinear(inputs, outputs, 2, rank, torch.bfloat16)
            for i in range(layers) for name, (inputs, outputs) in SHAPES.items()}
    adapter = {name: ([torch.randn(rank, m.lora_a_stacked[0].shape[-1], generator=g).bfloat16()
                       for _ in m.lora_a_stacked],
                      [torch.randn(b.shape[2], rank, generator=g).bfloat16() for b in m.lora_b_stacked])
               for name, m in mods.items()}
    return mods, adapter


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=number("positive_int"), default=28)
    ap.add_argument("--rank", type=number("positive_int"), default=8)
    ap.add_argument("--adapters", type=number("positive_int"), default=16)
    add_out_options(ap, "the table")
    args = ap.parse_args(argv)
    check_out(args)
    mods, adapter = model(args.layers, args.rank)
    writer = SlotWriter(mods)
    render, images = [], []
    for _ in range(args.adapters):
        t0 = time.perf_counter()
        images.append(writer.image(adapter.__getitem__))
        render.append(time.perf_counter() - t0)
    write = []
    for image in images:
        t0 = time.perf_counter()
        writer.write(image, 1)
        write.append(time.perf_counter() - t0)
    emit = Printed()
    emit(f"{dt.date.today()}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
         f"{torch.get_num_threads()} threads: {args.layers} Llama-3.2-3B layers, rank {args.rank}, bf16, "
         f"{args.adapters} images kept")
    emit()
    emit("| image MB | render ms (median) | write ms (median) |")
    emit("|---|---|---|")
    emit(f"| {image.flat.numel() * image.flat.element_size() / 1e6:.1f} | {1e3 * statistics.median(render):.1f} | "
         f"{1e3 * statistics.median(write):.1f} |")
    emit.write(args.out)


if __name__ == "__main__":
    main()
