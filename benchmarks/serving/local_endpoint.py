"""An OpenAI completions endpoint that streams each request's ``max_tokens`` tokens at a fixed gap,
so that ``vllm bench serve``'s own time per rate can be told apart from a server's
(:mod:`benchmarks.serving.bench_client_overhead`). It answers ``POST /v1/completions`` with
server-sent events as vLLM's server does (a chunk per token, then the usage, then ``[DONE]``),
and nothing else. Needs aiohttp (a vLLM dependency).

    python -m benchmarks.serving.local_endpoint --port 8765 [--gap-s 0.005]
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from serve_bridge.command_line import Parser, fail, number


def event(body: dict[str, Any]) -> bytes:
    """One server-sent event whose data is ``body``."""
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=number("port"), required=True)
    ap.add_argument("--gap-s", type=number("non_negative_number"), default=0.005, help="seconds between tokens")
    args = ap.parse_args(argv)
    try:
        from aiohttp import web
    except ImportError as e:
        fail(f"the local endpoint needs aiohttp ({e})")

    async def completions(request: Any) -> Any:
        n = (await request.json())["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(n):
            await asyncio.sleep(args.gap_s)
            await resp.write(event({"choices": [{"text": " t1", "index": 0}]}))
        await resp.write(event({"choices": [], "usage": {"completion_tokens": n, "prompt_tokens": 10}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions)])
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
