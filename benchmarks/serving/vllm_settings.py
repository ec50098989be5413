"""The vLLM settings a serving table's engines run with: vLLM's defaults, unless a second-line
table explains something else (benchmarks/README.md, vLLM settings).

vLLM 0.33's defaults: torch.compile with ``FULL_AND_PIECEWISE`` CUDA graphs (``config/vllm.py:267``:
decode batches replay full graphs, mixed prefill/decode steps piecewise ones), async scheduling
(``config/vllm.py:1685-1719``) and prefix caching. The non-default graph modes run without
torch.compile: ``full`` (``cudagraph_mode`` FULL: every step, mixed ones included, replays a full
graph of its token count padded up to the next capture size, ``v1/cudagraph_dispatcher.py:189-200``;
allowed without compilation where the attention backend supports mixed batches, FlashAttention 3
on the H200, ``config/compilation.py:635-638``, ``v1/attention/backends/flash_attn.py:341-345``) and
``decode`` (``FULL_DECODE_ONLY``: mixed steps eager), both of which start faster. vLLM's
adapter-count graph specialization (``specialize_active_lora``, off by default, ``config/lora.py:67``:
one decode graph per batch size and power-of-two adapter count) is a setting of the modes that run
vLLM's LoRA kernels; GridTrim's kernels ignore the adapter count, so it stays off for them.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

from serve_bridge.command_line import number
from serve_bridge.vllm.settings import GRIDTRIM_LAUNCH_ENV, gridtrim_launch_from_env

GRAPHS = ("default", "full", "decode")
GRAPH_LABEL = {"full": "full CUDA graphs", "decode": "decode-only CUDA graphs"}
CUDAGRAPH_MODE = {"full": "FULL", "decode": "FULL_DECODE_ONLY"}
# capture sizes of the non-default graph modes unless a table names others (default: vLLM's own)
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]


@dataclass(frozen=True)
class VllmSettings:
    """graphs: ``default`` (vLLM's), ``full`` or ``decode`` (module doc); async_scheduling,
    prefix_caching: vLLM's switches (on by default); capture_sizes: CUDA-graph sizes (None: vLLM's
    own with the default graphs, :data:`CAPTURE_SIZES` with the others); specialize_active_lora:
    vLLM's adapter-count graphs where vLLM's LoRA kernels run (off by default, module doc)."""

    graphs: str = "default"
    async_scheduling: bool = True
    prefix_caching: bool = True
    capture_sizes: tuple[int, ...] | None = None
    specialize_active_lora: bool = False

    def __post_init__(self) -> None:
        if self.graphs not in GRAPHS:
            raise ValueError(f"graphs={self.graphs!r}: use one of {', '.join(GRAPHS)}")
        if self.capture_sizes is not None:
            object.__setattr__(self, "capture_sizes", tuple(int(s) for s in self.capture_sizes))

    @property
    def defaults(self) -> bool:
        """Whether these are vLLM's defaults (the main configuration of every table)."""
        return self == VllmSettings()

    @property
    def tag(self) -> str:
        """What differs from vLLM's defaults, as a table marks its rows (empty for the defaults)."""
        parts = ([GRAPH_LABEL[self.graphs]] if self.graphs != "default" else []) + (
            [] if self.async_scheduling else ["sync"]) + ([] if self.prefix_caching else ["prefix caching off"]) + (
            ["capture sizes " + " ".join(map(str, self.capture_sizes))]
            if self.capture_sizes is not None and self.graphs == "default" else []) + (
            ["adapter-count graphs for vLLM's kernels"] if self.specialize_active_lora else [])
        return f"[{', '.join(parts)}]" if parts else ""

    def described(self) -> str:
        """How a table's preamble names these settings: their tag, or vLLM's defaults spelled out; under
        vLLM's compilation (the default graphs) also GridTrim's compiled launch (:func:`gridtrim_launch_note`)."""
        text = self.tag or "vLLM's defaults (torch.compile and its CUDA-graph mode, async scheduling, prefix caching)"
        return text + (f"; {gridtrim_launch_note()}" if self.graphs == "default" else "")  # else no compile

    def engine_options(self) -> dict[str, Any]:
        """The ``LLM``/``vllm serve`` options that differ from vLLM's defaults (none for them), but
        ``specialize_active_lora``, which is a LoRA option of some modes (``bench.engine_options``)."""
        opts: dict[str, Any] = {}
        if self.graphs != "default":
            opts["compilation_config"] = {"mode": 0, "cudagraph_mode": CUDAGRAPH_MODE[self.graphs],
                                          "cudagraph_capture_sizes": list(self.capture_sizes or CAPTURE_SIZES)}
        elif self.capture_sizes is not None:
            opts["compilation_config"] = {"cudagraph_capture_sizes": list(self.capture_sizes)}
        if not self.async_scheduling:
            opts["async_scheduling"] = False
        if not self.prefix_caching:
            opts["enable_prefix_caching"] = False
        return opts

    def arguments(self) -> list[str]:
        """These settings as :func:`add_arguments`' command-line options."""
        return (["--graphs", self.graphs] + ([] if self.async_scheduling else ["--sync"])
                + ([] if self.prefix_caching else ["--no-prefix-caching"])
                + (["--capture-sizes", *map(str, self.capture_sizes)] if self.capture_sizes is not None else [])
                + (["--specialize-active-lora"] if self.specialize_active_lora else []))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"capture_sizes": list(self.capture_sizes) if self.capture_sizes else None}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``--graphs``, ``--sync``, ``--no-prefix-caching``, ``--capture-sizes`` and
    ``--specialize-active-lora``: every mode of a table runs with them (the last where vLLM's LoRA
    kernels run); without any, vLLM's defaults."""
    g = ap.add_argument_group("vLLM settings (default: vLLM's defaults)")
    g.add_argument("--graphs", choices=GRAPHS, default="default",
                   help="default: torch.compile and vLLM's CUDA-graph mode; full: no torch.compile, a full CUDA "
                        "graph for every step up to the largest capture size; decode: no torch.compile, decode-only "
                        "CUDA graphs")
    g.add_argument("--sync", action="store_true", help="synchronous scheduling (vLLM's async scheduling off)")
    g.add_argument("--no-prefix-caching", action="store_true", help="prefix caching off")
    g.add_argument("--capture-sizes", type=number("positive_int"), nargs="+", default=None, metavar="SIZE",
                   help=f"CUDA-graph sizes (default: vLLM's with --graphs default, else {' '.join(map(str, CAPTURE_SIZES))})")
    g.add_argument("--specialize-active-lora", action="store_true",
                   help="vLLM's adapter-count CUDA graphs in the modes that run vLLM's LoRA kernels (stock, steptrim, "
                        "stockfix); off by default, as in vLLM")


def from_arguments(args: argparse.Namespace) -> VllmSettings:
    """The settings :func:`add_arguments` parsed."""
    return VllmSettings(args.graphs, not args.sync, not args.no_prefix_caching,
                        tuple(args.capture_sizes) if args.capture_sizes else None, args.specialize_active_lora)


def gridtrim_launch_note(launch: str | None = None) -> str:
    """How a table names GridTrim's compiled launch (docs/vllm_integration.md §4c): ``launch``, else
    the one ``LORAZOR_GRIDTRIM_LAUNCH`` gives this process and so every engine it starts."""
    return f"GridTrim's kernels launched by {launch or gridtrim_launch_from_env()} ({GRIDTRIM_LAUNCH_ENV})"
