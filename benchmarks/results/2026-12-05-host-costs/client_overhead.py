"""`vllm bench serve`'s time per rate beyond the rate's own duration: a process per rate (as the
harnesses ran it before 2026-12-05) against one process for every rate
(benchmarks/serving/bench_client.py), on chat512's 80.8 req/s dataset against local_endpoint.py.

    VLLM_PYTHON=/path/to/python-with-vllm python benchmarks/results/2026-12-05-host-costs/client_overhead.py WORK

Run from the repository root with the development environment's python; VLLM_PYTHON is a python
that has vLLM 0.33.0 and aiohttp (CPU torch is enough: the client needs no GPU).
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from benchmarks.serving import bench, bench_client, chat  # noqa: E402
from benchmarks.serving.chat_workload import add_shape_arguments, chat_rows, pool_for, shape_from  # noqa: E402
from benchmarks.serving.chat_workload import stream_key, write_dataset  # noqa: E402
from benchmarks.serving.goodput import Slo  # noqa: E402
from benchmarks.serving.synthetic import LLAMA32_3B, write_model_config, write_word_tokenizer  # noqa: E402

work, vllm_python, port = Path(sys.argv[1]), os.environ["VLLM_PYTHON"], 8765
model = write_model_config(work, LLAMA32_3B)
write_word_tokenizer(model, LLAMA32_3B)
parser = chat.argparse.ArgumentParser()
add_shape_arguments(parser)
shape = shape_from(parser.parse_args([]))
rate, n = 80.8, 1212
rows = chat_rows(shape, 0, stream_key(rate), n, pool_for(rate, shape.think_s, n))
dataset = work / "rate-80.8.jsonl"
write_dataset(dataset, rows, [bench.adapter_name(a) for a in range(shape.n_adapters)])
env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))


def options(name: str) -> list[str]:
    return chat.client_command(f"http://127.0.0.1:{port}", model, rate, n, dataset,
                               [bench.adapter_name(r.adapter) for r in rows], 0, Slo(), work / name, "lorazor")


def report(how: str, wall: float, name: str) -> None:
    data = json.loads((work / name).read_text())
    print(f"{how}: wall {wall:.2f} s, duration {data['duration']:.2f} s, beyond it {wall - data['duration']:.2f} s; "
          f"{data['completed']} completed")


endpoint = subprocess.Popen([vllm_python, str(Path(__file__).with_name("local_endpoint.py")), str(port)])
time.sleep(3)
try:
    t0 = time.monotonic()
    subprocess.run([vllm_python, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *options("fresh.json")],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    report("a process for the rate", time.monotonic() - t0, "fresh.json")
    bench_client.CHILD = [vllm_python, "-m", "benchmarks.serving.bench_client"]
    with bench_client.BenchClient(env, work / "client.log") as client:
        time.sleep(15)  # a server's start-up, during which the client imports vLLM
        for i in range(3):
            t0 = time.monotonic()
            assert client.run(options(f"kept{i}.json"), work / f"kept{i}.log", 300) == 0
            report(f"one process, rate {i + 1}", time.monotonic() - t0, f"kept{i}.json")
    same = [json.loads((work / f).read_text()) for f in ("fresh.json", "kept2.json")]
    print("same requests:", all(same[0][k] == same[1][k] for k in ("input_lens", "output_lens")))
finally:
    endpoint.terminate()
