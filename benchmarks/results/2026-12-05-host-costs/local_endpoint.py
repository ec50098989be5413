"""An OpenAI completions endpoint that streams ``max_tokens`` tokens at a fixed gap (default 5 ms),
so that `vllm bench serve`'s own time per rate can be told apart from a server's. Diagnostic only.

    python local_endpoint.py PORT [GAP_S]      (needs aiohttp)
"""
import asyncio
import json
import sys

from aiohttp import web

GAP = float(sys.argv[2]) if len(sys.argv) > 2 else 0.005


def event(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    n = (await request.json())["max_tokens"]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(n):
        await asyncio.sleep(GAP)
        await resp.write(event({"choices": [{"text": " t1", "index": 0}]}))
    await resp.write(event({"choices": [], "usage": {"completion_tokens": n, "prompt_tokens": 10}}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


app = web.Application()
app.add_routes([web.post("/v1/completions", completions)])
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
