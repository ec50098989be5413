"""``vllm bench serve``'s own time per rate: a process per rate against one process for every rate
(:mod:`benchmarks.serving.bench_client`, what the goodput and chat harnesses run), on chat512's
dataset at one rate against :mod:`benchmarks.serving.local_endpoint`. No GPU, no server.

    python -m benchmarks.serving.bench_client_overhead --work DIR [--vllm-python PY] [--rates 3] [--out FILE]

``--vllm-python`` is a Python with vLLM (CPU torch is enough: the client needs no GPU); it runs
the endpoint and the clients, this process only plans and times them. The first line is a fresh
``vllm bench serve`` process for the rate (import, tokenizer, dataset, requests, result), the next
``--rates`` the same rate in one kept client process that had 15 s to import vLLM first, as it
has while a server starts. Each line: wall seconds, the result's ``duration`` (first request
sent to last response) and the difference, the client's own time. The last line says whether the
fresh and the last kept run sent the same requests (their ``input_lens`` and ``output_lens``).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.printed import Printed, add_out_options, check_out
from benchmarks.serving import bench, bench_client, chat, goodput
from benchmarks.serving.chat_workload import ChatShape, chat_rows, pool_for, stream_key, write_dataset
from benchmarks.serving.goodput import ROOT, VLLM_CLI, Slo
from benchmarks.serving.synthetic import LLAMA32_3B, write_model_config, write_word_tokenizer
from benchmarks.serving.vllm_server import free_port
from serve_bridge.command_line import Parser, number


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="model directory, dataset and results go here")
    ap.add_argument("--vllm-python", default=sys.executable, help="a Python that has vLLM")
    ap.add_argument("--rate", type=number("positive_number"), default=80.8, help="req/s (chat512's goodput rate)")
    ap.add_argument("--rates", type=number("positive_int"), default=3, help="runs in the kept client process")
    add_out_options(ap, "the table")
    args = ap.parse_args(argv)
    check_out(args)
    model = write_model_config(args.work, LLAMA32_3B)
    write_word_tokenizer(model, LLAMA32_3B)
    shape = ChatShape()  # chat512's, the chat benchmark's defaults
    n = goodput.prompts_for(args.rate, chat.DURATION_S, chat.MIN_PROMPTS)
    rows = chat_rows(shape, 0, stream_key(args.rate), n, pool_for(args.rate, shape.think_s, n))
    dataset = args.work / f"rate-{args.rate:g}.jsonl"
    write_dataset(dataset, rows, [bench.adapter_name(a) for a in range(shape.n_adapters)])
    names = [bench.adapter_name(r.adapter) for r in rows]
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))

    def options(name: str) -> list[str]:
        return chat.client_command(f"http://127.0.0.1:{port}", model, args.rate, n, dataset, names, 0, Slo(),
                                   args.work / name, "lorazor")

    emit = Printed()
    emit(f"vllm bench serve at {args.rate:g} req/s, {n} chat512 requests, against a local endpoint "
         f"(tokens every 5 ms); `{' '.join(sys.argv)}`")
    emit()
    emit("| client | wall s | duration s | client's own s |")
    emit("|---|---|---|---|")

    def row(label: str, wall: float, name: str) -> dict:
        data = json.loads((args.work / name).read_text())
        emit(f"| {label} | {wall:.2f} | {data['duration']:.2f} | {wall - data['duration']:.2f} |")
        return data

    endpoint = subprocess.Popen([args.vllm_python, "-m", "benchmarks.serving.local_endpoint", "--port", str(port)],
                                cwd=ROOT, env=env)
    try:
        wait_listening(port, 60)
        t0 = time.monotonic()
        cli = [args.vllm_python, *VLLM_CLI[1:]]
        subprocess.run([*cli, "bench", "serve", *options("fresh.json")], env=env, check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        fresh = row("a process for the rate", time.monotonic() - t0, "fresh.json")
        bench_client.CHILD = [args.vllm_python, *bench_client.CHILD[1:]]
        with bench_client.BenchClient(env, args.work / "client.log") as client:
            time.sleep(15)  # a server's start-up, while the client imports vLLM
            for i in range(args.rates):
                t0 = time.monotonic()
                if client.run(options(f"kept{i}.json"), args.work / f"kept{i}.log", 600) != 0:
                    raise SystemExit(f"the kept client's run {i + 1} failed: {args.work / f'kept{i}.log'}")
                kept = row(f"one process, run {i + 1}", time.monotonic() - t0, f"kept{i}.json")
    finally:
        endpoint.terminate()
        endpoint.wait()
    same = all(fresh[k] == kept[k] for k in ("input_lens", "output_lens"))
    emit()
    emit(f"the same requests in the fresh run and the last kept one: {'yes' if same else 'NO'}")
    emit.write(args.out)


def wait_listening(port: int, timeout_s: float) -> None:
    """Return once something accepts connections on ``port`` (local), else exit with a message."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the local endpoint did not listen on port {port} within {timeout_s:g} s")


if __name__ == "__main__":
    main()
