"""The chat workload on CPU (benchmarks/serving/chat_workload.py): system prompts shared per adapter,
follow-ups that resend the conversation, Zipf popularity, the spacing of a conversation's turns,
determinism by seed, and the dataset file as vLLM 0.33.0's custom dataset reads it."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from benchmarks.serving import bench, synthetic
from benchmarks.serving.chat_workload import (ID_RANGE, ChatShape, chat_rows, pool_for, prep_rows,
                                              stream_key, system_prompts, words, write_dataset)
from benchmarks.serving.synthetic import write_word_tokenizer
from serve_bridge.capacity import popularity

SHAPE = ChatShape(n_adapters=64)


@pytest.fixture(scope="module")
def rows():
    return chat_rows(SHAPE, seed=3, key=stream_key(40.0), n_rows=3000, pool=pool_for(40.0, SHAPE.think_s, 3000))


def by_conversation(rows):
    out: dict[int, list] = {}
    for i, r in enumerate(rows):
        out.setdefault(r.conversation, []).append((i, r))
    return out


def test_every_request_starts_with_its_adapters_system_prompt(rows):
    systems = system_prompts(SHAPE, seed=3)
    assert all(SHAPE.system_len[0] <= len(s) <= SHAPE.system_len[1] for s in systems)
    assert len({tuple(s[:16]) for s in systems}) == SHAPE.n_adapters  # one per adapter
    for r in rows:
        assert r.prompt[:len(systems[r.adapter])] == systems[r.adapter]
    assert all(ID_RANGE[0] <= t < ID_RANGE[1] for r in rows[:200] for t in r.prompt)  # no special id
    # the same system prompts in every run of the seed; another seed, others
    other_run = chat_rows(SHAPE, seed=3, key=stream_key(80.0), n_rows=200, pool=8)
    assert all(r.prompt[:len(systems[r.adapter])] == systems[r.adapter] for r in other_run)
    assert system_prompts(SHAPE, seed=4)[0] != systems[0]


def test_follow_ups_resend_the_conversation(rows):
    systems = system_prompts(SHAPE, seed=3)
    follow_ups = 0
    for turns in by_conversation(rows).values():
        assert [r.turn for _, r in turns] == list(range(len(turns)))  # in order, none skipped
        assert len({r.adapter for _, r in turns}) == 1 and len(turns) <= SHAPE.max_turns
        first = turns[0][1]
        assert SHAPE.user_len[0] <= len(first.prompt) - len(systems[first.adapter]) <= SHAPE.user_len[1]
        for (_, prev), (_, cur) in zip(turns, turns[1:]):
            follow_ups += 1
            # the previous turn's whole prompt, then a reply of that turn's length, then the new message
            assert cur.prompt[:len(prev.prompt)] == prev.prompt
            added = len(cur.prompt) - len(prev.prompt) - prev.output_tokens
            assert SHAPE.user_len[0] <= added <= SHAPE.user_len[1]
        assert all(SHAPE.output_len[0] <= r.output_tokens <= SHAPE.output_len[1] for _, r in turns)
    assert follow_ups > 1000  # about 1.5 turns per conversation follow a first one


def test_adapters_follow_zipf():
    p = popularity(512, 1.0)
    shape = ChatShape(n_adapters=512)
    firsts = [r for r in chat_rows(shape, seed=0, key=1, n_rows=20000, pool=1) if r.turn == 0]  # one row per turn
    counts = Counter(r.adapter for r in firsts)
    n = len(firsts)
    for a in (0, 1, 4, 31):  # conversations on adapter a: within 4 standard deviations of Zipf's share
        assert abs(counts[a] - n * p[a]) < 4 * np.sqrt(n * p[a]), (a, counts[a], n * p[a])
    assert sum(counts[a] for a in range(32)) / n == pytest.approx(p[:32].sum(), abs=0.02)


def test_a_conversations_turns_come_pool_rows_apart():
    for pool in (5, 40):
        gaps = [j - i for turns in by_conversation(chat_rows(SHAPE, 0, 2, 4000, pool)).values()
                for (i, _), (j, _) in zip(turns, turns[1:])]
        assert np.mean(gaps) == pytest.approx(pool, rel=0.15)
    assert pool_for(40.0, 5.0, 3000) == 200 and pool_for(0.1, 5.0, 3000) == 1 and pool_for(900.0, 5.0, 300) == 300
    assert pool_for(float("inf"), 5.0, 512) == 512


def test_rows_are_determined_by_seed_and_run():
    a = chat_rows(SHAPE, 3, stream_key(12.5), 300, 60)
    assert a == chat_rows(SHAPE, 3, stream_key(12.5), 300, 60)
    assert a[:100] == chat_rows(SHAPE, 3, stream_key(12.5), 100, 60)  # fewer rows: the same first ones
    assert [r.prompt for r in a] != [r.prompt for r in chat_rows(SHAPE, 3, stream_key(12.6), 300, 60)]
    assert [r.prompt for r in a] != [r.prompt for r in chat_rows(SHAPE, 4, stream_key(12.5), 300, 60)]
    assert stream_key(float("inf")) == 0 and stream_key(12.5) == 126 and stream_key(0.5) == 6


def test_prep_rows_cover_each_adapter_with_disjoint_parts():
    fit, held = prep_rows(SHAPE, 0, 0, range(4), 10), prep_rows(SHAPE, 0, 1, range(4), 10)
    assert [r.adapter for r in fit] == [a for a in range(4) for _ in range(10)]
    assert not {tuple(r.prompt) for r in fit} & {tuple(r.prompt) for r in held}
    systems = system_prompts(SHAPE, 0)
    assert all(r.prompt[:len(systems[r.adapter])] == systems[r.adapter] for r in fit + held)
    assert {r.turn for r in fit + held} == set(range(SHAPE.max_turns))  # first turns and follow-ups
    assert fit == prep_rows(SHAPE, 0, 0, range(4), 10)


def test_dataset_file_as_vllms_custom_dataset_reads_it(tmp_path, rows):
    """vLLM 0.33.0's custom dataset: pandas.read_json(lines=True) with a 'prompt' column
    (benchmarks/datasets/datasets.py:2453-2465), each row's 'output_tokens' as int (:2507-2521), the
    prompt's length as the client tokenizer counts it without a chat template (:2529-2537)."""
    pd = pytest.importorskip("pandas")
    transformers = pytest.importorskip("transformers")
    names = [bench.adapter_name(a) for a in range(SHAPE.n_adapters)]
    path = tmp_path / "rate.jsonl"
    write_dataset(path, rows[:50], names)
    frame = pd.read_json(path_or_buf=str(path), lines=True)
    assert list(frame.columns[:2]) == ["prompt", "output_tokens"] and len(frame) == 50
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"prompt": words(rows[0].prompt), "output_tokens": rows[0].output_tokens,
                     "adapter": names[rows[0].adapter], "conversation": rows[0].conversation, "turn": rows[0].turn}
    model = tmp_path / "model"
    (model.mkdir(), (model / "config.json").write_text(json.dumps(synthetic.LLAMA32_3B)))
    write_word_tokenizer(model, synthetic.LLAMA32_3B)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    for (_, item), r in zip(frame.iterrows(), rows[:50]):
        assert int(item["output_tokens"]) == r.output_tokens
        assert tok(item["prompt"]).input_ids == r.prompt  # the prompt the server encodes, token for token
