"""Bad configs, bad data files, corrupt databases and broken adapters: each is caught by
the config's dataclasses (calibrate.config.check_config) or calibrate/validate.py (and the adapter
check it runs) with one clear error before any work, and no user file changes. Good inputs pass."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from safetensors.torch import save_file

from calibrate.__main__ import config_error
from calibrate.errors import ConfigError, UserError
from calibrate.config import check_config
from calibrate.context import Context
from calibrate.rundir import RunDir
from calibrate.validate import check_database, validate_task_data
from labeling.adapters import AdapterError, AdapterSpec, validate_adapter
from labeling.tasks import TaskError, build_task
from tests.calibrate.test_pipeline import TINY, compose_cfg
from tests.robustness.helpers import (BACKBONE_NAMES, HIDDEN, PREFIX, digest, make_adapter, make_database,
                                      spider_rows, write_jsonl)

# --- config: (override, error class, message fragment) ---------------------------------------
BAD_CONFIGS = [
    ("export.budget=-1", ConfigError, "export.budget=-1"),
    ("export.budget=nan", ConfigError, "export.budget"),
    ("export.budget=inf", ConfigError, "export.budget"),
    ("export.budget=lots", ConfigError, "export.budget='lots'"),
    ("export.rule=P0", ConfigError, "export.rule='P0'"),
    ("export.rule=P101", ConfigError, "export.rule='P101'"),
    ("export.rule=median", ConfigError, "export.rule='median'"),
    ("export.rule=P-5", ConfigError, "export.rule='P-5'"),
    ("export.policy=greedy", ConfigError, "export.policy='greedy'"),
    ("export.table_format=xlsx", ConfigError, "export.table_format"),
    ("task.sizes.train=-1", ConfigError, "task.sizes.train=-1"),
    ("task.sizes.validation=abc", ConfigError, "task.sizes.validation='abc'"),
    ("task.sizes.test=1.5", ConfigError, "task.sizes.test=1.5"),
    ("task.sizes.train=true", ConfigError, "task.sizes.train=True"),
    ("task.sizes.train=0", ConfigError, "task.sizes.train=0"),
    ("+task.sizes.dev=3", ConfigError, "task.sizes.dev: no such key"),
    ("task.options.max_new_tokens=0", ConfigError, "task.options.max_new_tokens=0"),
    ("task.options.max_new_tokens=many", ConfigError, "task.options.max_new_tokens='many'"),
    ("task.options.seed=x", ConfigError, "task.options.seed='x'"),
    ("+task.options.colour=red", ConfigError, "task.options.colour: no such key"),
    ("task.name=gsm8k", ConfigError, "task.name='gsm8k': the options are ArithOptions's"),
    ("task.name=nope", TaskError, "unknown task 'nope'"),
    ("labeling.points=[]", ConfigError, "labeling.points=[]"),
    ("labeling.points=[0,-1]", ConfigError, "labeling.points=[0, -1]"),
    ("labeling.points=[0,one]", ConfigError, "labeling.points"),
    ("labeling.points=3", ConfigError, "labeling.points=3"),
    ("labeling.task_points.counter=[]", ConfigError, "labeling.task_points.counter=[]"),
    ("+labeling.task_points.arith=[0,-3]", ConfigError, "labeling.task_points.arith=[0, -3]"),
    ("labeling.shard_requests=0", ConfigError, "labeling.shard_requests='0'"),
    ("labeling.shard_requests=some", ConfigError, "labeling.shard_requests='some'"),
    ("predictor.lam=0", ConfigError, "predictor.lam=0"),
    ("predictor.lam=-0.5", ConfigError, "predictor.lam=-0.5"),
    ("sweep.n_tau=0", ConfigError, "sweep.n_tau=0"),
    ("sweep.ks=[]", ConfigError, "sweep.ks=[]"),
    ("sweep.ks=[1,-2]", ConfigError, "sweep.ks"),
    ("engine.batch_size=0", ConfigError, "engine.batch_size=0"),
    ("engine.batch_size=big", ConfigError, "engine.batch_size='big'"),
    ("engine.progress=maybe", ConfigError, "engine.progress='maybe'"),
    ("engine=hf;engine.workers=0", ConfigError, "engine.workers='0'"),
    ("engine=hf;engine.workers=many", ConfigError, "engine.workers='many'"),
    ("engine.name=tgi", ConfigError, "engine='tgi'"),
    ("backbone.dtype=int8", ConfigError, "backbone.dtype='int8'"),
    ("backbone.gguf_file=null", ConfigError, "backbone.gguf_file=None"),
    ("stages=[]", ConfigError, "stages=[]"),
    ("stages=data", ConfigError, "stages='data'"),
    ("agreement=perhaps", ConfigError, "agreement='perhaps'"),
    ("adapter.adapters=[{name: a}]", ConfigError, "adapter.adapters[0]"),
    ("adapter.adapters=[{name: '', path: /x}]", ConfigError, "adapter.adapters[0].name=''"),
    ("engine=vllm;engine.gpu_memory_utilization=1.5", ConfigError, "engine.gpu_memory_utilization=1.5"),
    ("engine=vllm;engine.tensor_parallel_size=0", ConfigError, "engine.tensor_parallel_size=0"),
    ("engine=vllm;engine.max_num_seqs=-4", ConfigError, "engine.max_num_seqs=-4"),
    ("engine=vllm;engine.kv_cache_memory_bytes=0", ConfigError, "engine.kv_cache_memory_bytes=0"),
    ("engine=vllm;engine.max_lora_rank=zero", ConfigError, "engine.max_lora_rank='zero'"),
    ("engine=vllm;engine.dtype=fp8", ConfigError, "engine.dtype='fp8'"),
    ("task.options=5", ConfigError, "task.options=5: task.options is a group of keys"),
    ("task.options='fast'", ConfigError, "task.options='fast'"),
    ("sweep.skip_levels=[2]", ConfigError, "sweep.skip_levels=[2.0]"),
    ("sweep.skip_levels=[0,0.5]", ConfigError, "sweep.skip_levels=[0.0, 0.5]"),
    ("sweep.skip_levels=[-0.1]", ConfigError, "sweep.skip_levels=[-0.1]"),
    ("backbone.hf_id=/nowhere", ConfigError, "backbone.hf_id='/nowhere': the backbone loads from its GGUF"),
]


@pytest.mark.parametrize("override,error,fragment", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_is_one_clear_error(override: str, error: type, fragment: str) -> None:
    """Hydra's schema refuses a value of the wrong type while composing (the CLI prints it as one
    line, calibrate.__main__.config_error); the config's dataclasses refuse the rest when
    check_config builds them."""
    try:
        cfg = compose_cfg([*TINY, *override.split(";")])
    except ConfigCompositionException as err:
        line = config_error(err)
        assert fragment.split("=")[0].split("'")[0] in line and "\n" not in line, line
        return
    with pytest.raises(error) as info:
        check_config(cfg)
    assert isinstance(info.value, UserError)
    message = str(info.value)
    assert fragment in message and "\n" not in message, message


GOOD_CONFIGS = ["", "export.rule=budget;export.budget=0", "export.budget=1e-05", "export.budget=1e20", "sweep.skip_levels=[]", "export.rule=P100", "export.policy=profiled",
                "labeling.points=[0]", "task.sizes.train=null", "engine=vllm", "labeling.shard_requests=auto", "engine=hf;engine.workers=2",
                "task=gsm8k;task.options.source=/data/gsm8k", "+labeling.task_points.arith=[0,5]"]


@pytest.mark.parametrize("overrides", GOOD_CONFIGS)
def test_good_config_passes(overrides: str) -> None:
    check_config(compose_cfg([*TINY, *filter(None, overrides.split(";"))]))


# The demo's mix task: each part is checked as a task of its own when the run builds its task,
# before any model loads.
BAD_DEMO_CONFIGS = [
    ("task.options.parts.counter.sizes.train=-1", "part 'counter': train=-1"),
    ("task.options.parts.counter.options.max_moves=0", "part 'counter': max_moves=0"),
    ("+task.options.parts.counter.options.colour=red", "task 'counter' has no option 'colour'"),
    ("+task.options.parts.counter.sizes.dev=4", "task 'counter' has no split size 'dev'"),
    ("+task.options.parts.counter.extra=1", "part 'counter': unknown key 'extra'"),
    ("+task.options.parts.mix={}", "a part cannot itself be a mix"),
    ("task.sizes.train=5", "sizes per part"),
]


def demo_task(tmp_path: Path, *overrides: str) -> object:
    return Context(compose_cfg(["task=demo", "adapter=demo", *overrides]), RunDir(tmp_path)).task


@pytest.mark.parametrize("override,fragment", BAD_DEMO_CONFIGS, ids=[c[0] for c in BAD_DEMO_CONFIGS])
def test_bad_demo_config_is_one_clear_error(tmp_path: Path, override: str, fragment: str) -> None:
    with pytest.raises(UserError) as info:
        demo_task(tmp_path, override)
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_demo_config_passes(tmp_path: Path) -> None:
    check_config(compose_cfg([]))
    assert sorted(demo_task(tmp_path).parts) == ["arith", "counter"]


# --- local data files ---------------------------------------------------------------------
GOOD_GSM8K = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}


def _gsm8k(tmp_path: Path, train: bytes) -> tuple[object, Path]:
    src = tmp_path / "gsm8k"
    src.mkdir()
    (src / "train.jsonl").write_bytes(train)
    write_jsonl(src / "test.jsonl", [GOOD_GSM8K] * 2)
    return build_task("gsm8k", source=str(src)), src


def _lines(*rows: object) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


BAD_DATA = {  # name: (train file bytes, message fragment; {file} is the train file)
    "malformed_json": (_lines(GOOD_GSM8K, b'{"question": "x", "answer": '), "{file}:2: not valid JSON"),
    "trailing_garbage": (_lines(GOOD_GSM8K, GOOD_GSM8K, b'{"question": "x", "answer": "1"} extra'),
                         "{file}:3: not valid JSON"),
    "non_utf8": (_lines(GOOD_GSM8K, b'{"question": "caf\xe9", "answer": "#### 1"}'), "{file}:2: not valid UTF-8"),
    "latin1_bom_free": (_lines(b'{"question": "\xff\xfe", "answer": "#### 1"}'), "{file}:1: not valid UTF-8"),
    "missing_answer": (_lines(GOOD_GSM8K, {"question": "x"}), "{file}:2: missing field 'answer'"),
    "null_question": (_lines({"question": None, "answer": "#### 1"}), "{file}:1: missing field 'question'"),
    "answer_is_number": (_lines({"question": "x", "answer": 5}), "{file}:1: field 'answer' is a JSON number"),
    "answer_is_bool": (_lines({"question": "x", "answer": True}), "{file}:1: field 'answer' is a JSON boolean"),
    "row_is_array": (_lines(GOOD_GSM8K, ["x", "y"]), "{file}:2: a JSON array"),
    "row_is_string": (_lines('"just text"'), "{file}:1: a JSON string"),
    "mixed_types": (_lines({**GOOD_GSM8K, "id": 1}, {**GOOD_GSM8K, "id": "two"}),
                    "{file}:2: field 'id' is a JSON string here but a number on line 1"),
    "blank_lines_then_bad": (_lines(GOOD_GSM8K) + b"\n\n" + _lines({"answer": "#### 2"}),
                             "{file}:4: missing field 'question'"),
    # bounded, strict parsing: what Python's json accepts but datasets (pyarrow) refuses or misreads
    "nesting_past_the_stack": (_lines(GOOD_GSM8K, b'{"question": "x", "answer": "1", "m": ' + b"[" * 100_000
                                      + b"]" * 100_000 + b"}"), "{file}:2: not valid JSON (nested too deeply"),
    "nesting_past_the_bound": (_lines({**GOOD_GSM8K, "m": json.loads("[" * 40 + "]" * 40)}),
                               "{file}:1: not valid JSON (nested deeper than 32 levels"),
    "integer_5000_digits": (_lines(b'{"question": "x", "answer": "#### 1", "id": ' + b"7" * 5000 + b"}"),
                            "{file}:1: not valid JSON (integer of 5000 digits"),
    "integer_past_int64": (_lines({**GOOD_GSM8K, "id": 2 ** 63}), "{file}:1: not valid JSON (integer of 19 digits "
                                                                    "does not fit 64-bit storage"),
    "float_overflow": (_lines(b'{"question": "x", "answer": "#### 1", "w": 1e400}'), "overflows a 64-bit float"),
    "nan": (_lines(b'{"question": "x", "answer": "#### 1", "w": NaN}'), "{file}:1: not valid JSON (NaN is not"),
    "duplicate_key": (_lines(GOOD_GSM8K, b'{"question": "x", "answer": "#### 1", "answer": "#### 2"}'),
                      "{file}:2: not valid JSON (duplicate key 'answer'"),
    "lone_surrogate": (_lines(b'{"question": "caf\\ud800", "answer": "#### 1"}'),
                       "{file}:1: not valid JSON (string 'caf\\ud800' holds a lone UTF-16 surrogate"),
    "lone_surrogate_key": (_lines(b'{"question": "x", "answer": "#### 1", "\\udc00": 1}'), "lone UTF-16 surrogate"),
    "line_past_16_mib": (_lines({"question": "x" * (16 << 20), "answer": "#### 1"}), "{file}:1: a line of 16777"),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_data_file_names_file_and_line(tmp_path: Path, case: str) -> None:
    content, fragment = BAD_DATA[case]
    task, src = _gsm8k(tmp_path, content)
    before = digest(src)
    with pytest.raises(TaskError) as info:
        validate_task_data(task)
    message = str(info.value)
    assert fragment.format(file=src / "train.jsonl") in message and "\n" not in message, message
    assert digest(src) == before


def test_json_array_file_with_a_bad_row(tmp_path: Path) -> None:
    src = tmp_path / "gsm8k"
    src.mkdir()
    (src / "train.json").write_text(json.dumps([GOOD_GSM8K, {"question": "q"}]))
    write_jsonl(src / "test.jsonl", [GOOD_GSM8K])
    with pytest.raises(TaskError, match="missing field 'answer'"):
        validate_task_data(build_task("gsm8k", source=str(src)))


def test_shipped_gsm8k_subset_passes_and_loads() -> None:
    from calibrate.resolvers import DATA_DIR

    task = build_task("gsm8k", source=str(DATA_DIR / "gsm8k_subset"), val_size=8)
    validate_task_data(task)
    assert len(task.load_split("validation")) == 8


def test_generated_task_has_no_files_to_check() -> None:
    validate_task_data(build_task("arith"))


def test_missing_local_split_file(tmp_path: Path) -> None:
    src = tmp_path / "gsm8k"
    write_jsonl(src / "train.jsonl", [GOOD_GSM8K])
    with pytest.raises(TaskError, match="has no test.jsonl or test.json"):
        validate_task_data(build_task("gsm8k", source=str(src)))


# --- Spider databases ---------------------------------------------------------------------

def _spider(tmp_path: Path, db: str = "concert_singer", wal: bool = False) -> tuple[object, Path]:
    src, dbs = tmp_path / "spider", tmp_path / "database"
    write_jsonl(src / "train.jsonl", spider_rows(4, db))
    write_jsonl(src / "validation.jsonl", spider_rows(2, db))
    make_database(dbs / "concert_singer" / "concert_singer.sqlite", wal=wal)
    return build_task("spider", source=str(src), db_dir=str(dbs)), dbs


def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "garbage":
        path.write_bytes(b"this is not a database at all" * 100)
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "truncated_header":
        path.write_bytes(data[:60])
    elif how == "truncated_pages":
        path.write_bytes(data[: len(data) // 3])
    elif how == "scribbled_pages":
        page = int.from_bytes(data[16:18], "big")
        path.write_bytes(data[:page] + bytes(range(256)) * ((len(data) - page) // 256 + 1))


@pytest.mark.parametrize("how", ["garbage", "empty", "truncated_header", "truncated_pages", "scribbled_pages"])
def test_corrupt_spider_database(tmp_path: Path, how: str) -> None:
    task, dbs = _spider(tmp_path)
    _corrupt(dbs / "concert_singer" / "concert_singer.sqlite", how)
    before = digest(dbs)
    with pytest.raises(TaskError) as info:
        validate_task_data(task)
    assert "concert_singer.sqlite" in str(info.value) and "\n" not in str(info.value)
    assert digest(dbs) == before


def test_missing_spider_database(tmp_path: Path) -> None:
    task, _ = _spider(tmp_path, db="other_db")
    with pytest.raises(TaskError, match="database for db_id 'other_db' not found"):
        validate_task_data(task)


@pytest.mark.parametrize("wal", [False, True])
def test_good_spider_database_is_read_without_writing_next_to_it(tmp_path: Path, wal: bool) -> None:
    task, dbs = _spider(tmp_path, wal=wal)
    before = digest(dbs)
    validate_task_data(task)
    assert digest(dbs) == before  # no -wal/-shm/-journal file appeared, the file is unchanged


def test_check_database_accepts_a_database_with_an_open_writer(tmp_path: Path) -> None:
    db = make_database(tmp_path / "db.sqlite", wal=True)
    writer = sqlite3.connect(db)
    writer.execute("INSERT INTO singer (name, age) VALUES ('late', 99)")
    writer.commit()  # the row lives in db.sqlite-wal until a checkpoint
    try:
        before = digest(tmp_path)
        check_database(db)
        assert digest(tmp_path) == before
    finally:
        writer.close()


# --- adapters -----------------------------------------------------------------------------

def _pair(r_a: int, r_b: int, hidden: int = HIDDEN, module: str = "q_proj") -> dict[str, torch.Tensor]:
    return {f"{PREFIX}.{module}.lora_A.weight": torch.zeros(r_a, hidden),
            f"{PREFIX}.{module}.lora_B.weight": torch.zeros(hidden, r_b)}


def _truncate(at: float):
    def f(d: Path) -> None:
        p = d / "adapter_model.safetensors"
        data = p.read_bytes()
        p.write_bytes(data[: int(len(data) * at)])
    return f


def _write(name: str, content: bytes):
    def f(d: Path) -> None:
        (d / name).write_bytes(content)
    return f


BAD_ADAPTERS = {  # name: (make_adapter kwargs, damage applied after, message fragment)
    "truncated_header": ({}, _truncate(0.00001), "not a complete safetensors file"),
    "truncated_half": ({}, _truncate(0.5), "not a complete safetensors file"),
    "truncated_last_byte": ({}, _truncate(0.99999), "not a complete safetensors file"),
    "weights_empty_file": ({}, _write("adapter_model.safetensors", b""), "not a complete safetensors file"),
    "config_not_json": ({}, _write("adapter_config.json", b"{peft_type: LORA"), "is not valid JSON"),
    "config_truncated": ({}, _write("adapter_config.json", b'{"peft_type": "LORA", "r": 4,'), "is not valid JSON"),
    "config_non_utf8": ({}, _write("adapter_config.json", b'{"peft_type": "LOR\xc0"}'), "not valid UTF-8"),
    "config_is_array": ({}, _write("adapter_config.json", b"[1, 2]"), "holds a JSON list"),
    "config_empty": ({}, _write("adapter_config.json", b""), "is not valid JSON"),
    "peft_type_ia3": ({"config": {"peft_type": "IA3"}}, None, "'IA3' adapter, not LORA"),
    "r_zero": ({"config": {"r": 0}}, None, "r=0"),
    "r_negative": ({"config": {"r": -4}}, None, "r=-4"),
    "r_string": ({"config": {"r": "4"}}, None, "r='4'"),
    "r_bool": ({"config": {"r": True}}, None, "r=True"),
    "r_missing": ({"config": {"r": None}}, None, "r=None"),
    "rank_pattern_zero": ({"config": {"rank_pattern": {"q_proj": 0}}}, None, "rank_pattern['q_proj']=0"),
    "alpha_zero": ({"config": {"lora_alpha": 0}}, None, "lora_alpha=0"),
    "alpha_text": ({"config": {"lora_alpha": "high"}}, None, "lora_alpha='high'"),
    "no_targets": ({"config": {"target_modules": []}}, None, "target_modules=[]"),
    "other_base_model": ({"config": {"base_model_name_or_path": "meta-llama/Llama-3.2-3B-Instruct"}}, None,
                         "names base model 'meta-llama/Llama-3.2-3B-Instruct'"),
    "other_base_model_path": ({"config": {"base_model_name_or_path": "/models/mistral-7b-v0.3"}}, None,
                              "names base model"),
    "wrong_hidden": ({"hidden": 4096}, None, "hidden size 4096"),
    "rank_differs_from_config": ({"tensors": _pair(8, 8)}, None, "r=4"),
    "a_b_ranks_differ": ({"tensors": _pair(4, 2)}, None, "expected [r, in] and [out, r]"),
    "lora_b_missing": ({"tensors": dict(list(_pair(4, 4).items())[:1])}, None, "missing"),
    "no_lora_tensors": ({"tensors": {"model.embed_tokens.weight": torch.zeros(4, 4)}}, None, "holds no LoRA weights"),
    "one_dim_lora_a": ({"tensors": {f"{PREFIX}.q_proj.lora_A.weight": torch.zeros(4),
                                    f"{PREFIX}.q_proj.lora_B.weight": torch.zeros(HIDDEN, 4)}}, None,
                       "expected [r, in]"),
    "target_modules_number": ({"config": {"target_modules": 5}}, None, "target_modules=5"),
    "target_modules_object": ({"config": {"target_modules": {"q_proj": 1}}}, None, "target_modules={'q_proj': 1}"),
    "target_modules_numbers": ({"config": {"target_modules": ["q_proj", 3]}}, None, "target_modules=['q_proj', 3]"),
    "target_modules_empty_name": ({"config": {"target_modules": ["q_proj", ""]}}, None, "target_modules=['q_proj', '']"),
    "rank_pattern_list": ({"config": {"rank_pattern": [4]}}, None, "rank_pattern=[4]"),
    "rank_pattern_text": ({"config": {"rank_pattern": "q_proj=4"}}, None, "rank_pattern='q_proj=4'"),
    "alpha_pattern_text_value": ({"config": {"alpha_pattern": {"q_proj": "x"}}}, None, "alpha_pattern['q_proj']='x'"),
    "scalar_lora_a": ({"tensors": {f"{PREFIX}.q_proj.lora_A.weight": torch.zeros(()),
                                   f"{PREFIX}.q_proj.lora_B.weight": torch.zeros(HIDDEN, 4)}}, None,
                      "lora_A.weight of shape [] and"),
    "config_duplicate_key": ({}, _write("adapter_config.json", b'{"peft_type": "LORA", "r": 4, "r": 8}'),
                             "not valid JSON (duplicate key 'r'"),
    "missing_weights": ({}, lambda d: (d / "adapter_model.safetensors").unlink(), "is missing"),
    "missing_config": ({}, lambda d: (d / "adapter_config.json").unlink(), "is missing"),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_bad_adapter_is_one_clear_error(tmp_path: Path, case: str) -> None:
    kwargs, damage, fragment = BAD_ADAPTERS[case]
    config = {k: v for k, v in kwargs.get("config", {}).items()}
    d = make_adapter(tmp_path / "lora", **{**kwargs, "config": config})
    if damage:
        damage(d)
    before = digest(d)
    with pytest.raises(AdapterError) as info:
        validate_adapter(AdapterSpec("sql-a", str(d)), HIDDEN, BACKBONE_NAMES)
    message = str(info.value)
    assert fragment in message and "sql-a" in message and "\n" not in message, message
    assert digest(d) == before


@pytest.mark.parametrize("base", ["HuggingFaceTB/SmolLM2-135M-Instruct", "/tmp/lorazor/backbones/smollm2", "",
                                  "smollm2"])
def test_adapter_for_this_backbone_passes(tmp_path: Path, base: str) -> None:
    d = make_adapter(tmp_path / "lora", config={"base_model_name_or_path": base})
    assert validate_adapter(AdapterSpec("a", str(d)), HIDDEN, BACKBONE_NAMES)["r"] == 4


def test_shipped_demo_adapter_passes() -> None:
    from tests.conftest import DEMO_ADAPTER

    assert validate_adapter(AdapterSpec("arith-a", str(DEMO_ADAPTER)), HIDDEN, BACKBONE_NAMES)["r"] == 8


def test_rank_pattern_allows_per_module_ranks(tmp_path: Path) -> None:
    tensors = {**_pair(4, 4), **_pair(2, 2, module="v_proj")}
    d = make_adapter(tmp_path / "lora", config={"rank_pattern": {"v_proj": 2}}, tensors=tensors)
    validate_adapter(AdapterSpec("a", str(d)), HIDDEN, BACKBONE_NAMES)


def test_safetensors_header_only_file(tmp_path: Path) -> None:
    d = make_adapter(tmp_path / "lora")
    save_file({}, str(d / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="holds no LoRA weights"):
        validate_adapter(AdapterSpec("a", str(d)), HIDDEN, BACKBONE_NAMES)
