"""The chat workload of :mod:`benchmarks.serving.chat`: per-adapter system prompts, multi-turn
conversations whose follow-ups resend the conversation, Zipf-skewed adapter popularity.

Pure and seeded (numpy only), tested on CPU. Token ids are words of the dummy model's word
tokenizer (:func:`benchmarks.serving.synthetic.write_word_tokenizer`: id i is ``t<i>``), drawn
uniformly in [3, 128000), below the config's bos and eos ids, so a prompt of n ids is a text of n
tokens for the client and the server alike.

- **Popularity.** Adapter a (0 … N−1) has rank a+1: a conversation is on adapter a with
  probability ∝ (a+1)^−s (``zipf``, s = 1: at 512 adapters the first gets 14.7% of the
  conversations and the first 32 together 60%), the capacity model's
  :func:`serve_bridge.capacity.popularity`.
- **System prompts.** Adapter a has one system prompt of ``system_len`` tokens (uniform, default
  200–400), drawn from the seed alone: every conversation on a starts with it, in every run.
- **Conversations.** 1 … ``max_turns`` turns (uniform), each a user message of ``user_len``
  tokens and a reply of ``output_len`` tokens (``output_tokens``, served with ``ignore_eos``).
  Turn k's prompt is the system prompt, then each earlier turn's user message and reply, then
  user message k: a follow-up resends the conversation, so the previous turn's whole prompt is a
  prefix of it (blocks a prefix cache can reuse, besides the system prompt). A static dataset
  cannot hold the server's own reply: the resent reply is a stand-in of the reply's length.
- **Order.** Rows are sent in order, at the client's Poisson times. ``pool`` conversations are
  open at once; each row is the next turn of one of them, chosen uniformly, and a finished
  conversation is replaced by a new one. With ``pool = rate × think_s`` (:func:`pool_for`) a
  conversation's next turn arrives on average ``think_s`` after its previous one, whatever the
  rate; it does not wait for the reply (open loop).
- **Runs.** Each run (a rate of the sweep, :func:`stream_key`) has its own conversations, the
  same for every mode; the system prompts are shared by all runs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from serve_bridge.capacity import popularity
from serve_bridge.command_line import MinMax, number
from serve_bridge.safe_write import write_atomic

ID_RANGE = (3, 128000)  # word-tokenizer ids below Llama-3.2-3B's bos (128000) and eos (128001)


@dataclass(frozen=True)
class ChatShape:
    """The workload's parameters (inclusive ranges in tokens)."""

    n_adapters: int = 512
    zipf: float = 1.0
    system_len: tuple[int, int] = (200, 400)
    user_len: tuple[int, int] = (20, 100)
    output_len: tuple[int, int] = (20, 100)
    max_turns: int = 4
    think_s: float = 5.0


@dataclass(frozen=True)
class Row:
    """One request: its adapter, conversation and turn (from 0), prompt ids and output length."""

    adapter: int
    conversation: int
    turn: int
    prompt: list[int]
    output_tokens: int


@dataclass(frozen=True)
class Conversation:
    """A conversation's adapter and, per turn, its user message and reply (token ids)."""

    adapter: int
    users: list[list[int]]
    replies: list[list[int]]

    def prompt(self, system: list[int], turn: int) -> list[int]:
        """Turn ``turn``'s prompt: the system prompt, earlier turns' messages and replies, this message."""
        out = list(system)
        for user, reply in zip(self.users[:turn], self.replies[:turn]):
            out += user + reply
        return out + self.users[turn]


def _ids(rng: np.random.Generator, length_range: tuple[int, int]) -> list[int]:
    n = int(rng.integers(length_range[0], length_range[1] + 1))
    return rng.integers(*ID_RANGE, n).tolist()


def system_prompts(shape: ChatShape, seed: int) -> list[list[int]]:
    """Each adapter's system prompt (the seed alone decides them)."""
    rng = np.random.default_rng([seed, 0])
    return [_ids(rng, shape.system_len) for _ in range(shape.n_adapters)]


def conversation(rng: np.random.Generator, shape: ChatShape, adapter: int) -> Conversation:
    """A conversation on ``adapter``: 1 … max_turns turns of a user message and a reply."""
    turns = int(rng.integers(1, shape.max_turns + 1))
    return Conversation(adapter, [_ids(rng, shape.user_len) for _ in range(turns)],
                        [_ids(rng, shape.output_len) for _ in range(turns)])


def stream_key(rate: float) -> int:
    """The run's key: 0 for the all-at-once probe, else the rate in tenths plus one."""
    return 0 if math.isinf(rate) else round(rate * 10) + 1


def pool_for(rate: float, think_s: float, n_rows: int) -> int:
    """Open conversations that space a conversation's turns ``think_s`` apart at ``rate`` req/s
    (all ``n_rows`` at once for the probe), at least 1."""
    return n_rows if math.isinf(rate) else max(1, min(n_rows, round(rate * think_s)))


def chat_rows(shape: ChatShape, seed: int, key: int, n_rows: int, pool: int) -> list[Row]:
    """The first ``n_rows`` requests of run ``key``: turns of ``pool`` open conversations (module doc)."""
    rng = np.random.default_rng([seed, 1, key])
    systems = system_prompts(shape, seed)
    p = popularity(shape.n_adapters, shape.zipf)

    def new() -> tuple[Conversation, int]:
        c = conversation(rng, shape, int(rng.choice(shape.n_adapters, p=p)))
        return c, 0

    open_ = [new() for _ in range(pool)]
    ids = list(range(pool))  # conversation number of each open slot
    started = pool
    rows = []
    for _ in range(n_rows):
        j = int(rng.integers(len(open_)))
        c, turn = open_[j]
        rows.append(Row(c.adapter, ids[j], turn, c.prompt(systems[c.adapter], turn), len(c.replies[turn])))
        if turn + 1 < len(c.users):
            open_[j] = (c, turn + 1)
        else:
            open_[j], ids[j], started = new(), started, started + 1
    return rows


def prep_rows(shape: ChatShape, seed: int, part: int, adapters: range, per_adapter: int) -> list[Row]:
    """``per_adapter`` requests on each of ``adapters``: for each a new conversation on it and one
    of its turns (uniform), so prompts have the served mix of first turns and follow-ups; ``part``
    keys disjoint draws (e.g. fitting and held-out requests)."""
    systems = system_prompts(shape, seed)
    rows = []
    for a in adapters:
        rng = np.random.default_rng([seed, 2, part, a])
        for i in range(per_adapter):
            c = conversation(rng, shape, a)
            turn = int(rng.integers(len(c.users)))
            rows.append(Row(a, i, turn, c.prompt(systems[a], turn), len(c.replies[turn])))
    return rows


def words(ids: list[int]) -> str:
    """Token ids as the word tokenizer's text."""
    return " ".join(f"t{i}" for i in ids)


def write_dataset(path: Path, rows: list[Row], names: list[str]) -> None:
    """``vllm bench serve``'s custom dataset (JSONL): per row ``prompt`` (words), ``output_tokens``,
    and, for the reader (vLLM reads only the first two), ``adapter`` (its name), ``conversation``
    and ``turn``; written whole or not at all (:func:`write_atomic`), as it is kept between calls."""
    write_atomic(path, "".join(json.dumps({"prompt": words(r.prompt), "output_tokens": r.output_tokens,
                                           "adapter": names[r.adapter], "conversation": r.conversation,
                                           "turn": r.turn}) + "\n" for r in rows))


def add_shape_arguments(ap: argparse.ArgumentParser) -> None:
    """The workload's options (defaults: :class:`ChatShape`'s); :func:`shape_from` reads them."""
    d = ChatShape()
    ap.add_argument("--adapters", type=number("positive_int"), default=d.n_adapters,
                    help="adapters served, in popularity order")
    ap.add_argument("--zipf", type=number("non_negative_number"), default=d.zipf,
                    help="popularity exponent s: P(adapter a) ∝ (a+1)^-s")
    ap.add_argument("--system-len", type=number("positive_int"), nargs=2, action=MinMax,
                    default=d.system_len, metavar=("MIN", "MAX"),
                    help="tokens of each adapter's system prompt")
    ap.add_argument("--user-len", type=number("positive_int"), nargs=2, action=MinMax,
                    default=d.user_len, metavar=("MIN", "MAX"),
                    help="tokens of a user message")
    ap.add_argument("--output-len", type=number("positive_int"), nargs=2, action=MinMax,
                    default=d.output_len, metavar=("MIN", "MAX"),
                    help="tokens of a reply")
    ap.add_argument("--max-turns", type=number("positive_int"), default=d.max_turns,
                    help="turns of a conversation, 1 to this")
    ap.add_argument("--think-s", type=number("non_negative_number"), default=d.think_s,
                    help="mean seconds between a conversation's turns (open conversations = rate x this)")


def shape_arguments(shape: ChatShape) -> list[str]:
    """The options of :func:`add_shape_arguments` that give ``shape``."""
    return ["--adapters", str(shape.n_adapters), "--zipf", f"{shape.zipf:g}",
            "--system-len", *map(str, shape.system_len), "--user-len", *map(str, shape.user_len),
            "--output-len", *map(str, shape.output_len), "--max-turns", str(shape.max_turns),
            "--think-s", f"{shape.think_s:g}"]


def shape_key(shape: ChatShape, seed: int) -> str:
    """A short name for (shape, seed): files drawn from them (datasets, the learned bundle) are kept under it."""
    text = json.dumps([asdict(shape), seed], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def shape_from(args: argparse.Namespace) -> ChatShape:
    """The :class:`ChatShape` of :func:`add_shape_arguments`' options."""
    return ChatShape(args.adapters, args.zipf, tuple(args.system_len), tuple(args.user_len), tuple(args.output_len),
                     args.max_turns, args.think_s)
