"""Train a LoRA adapter with peft for a task on a backbone (GPU or CPU).

Two steps, so the GPU box needs neither `datasets` nor the task code's data sources:

  # here: render the task's train split and an eval split into JSONL
  python scripts/train_adapter.py prepare --task arith --out build/arith.jsonl
  # anywhere with torch + transformers + peft (+ gguf for the embedded backbone)
  python scripts/train_adapter.py train --data build/arith.jsonl --out adapters/arith-a \
      --rank 8 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --seed 0

`train` ends by printing greedy accuracy of full LoRA vs the backbone alone on the
eval rows, scored by the evaluator that `prepare --evaluator` recorded in each row (numeric
match by default; `restated` for the counter task), and saves the adapter in fp16
safetensors (peft format). Generation stops at the backbone's stop tokens, as calibration's.

Both steps keep the contract of every LoRazor command (serve_bridge/command_line.py): a user
mistake is one line on stderr and exit code 2, before any model loads and before anything is
written. The checks are calibration's own: argument ranges by the shared rules
(serve_bridge/values.py), the task's data and `--data` line by line (calibrate/validate.py,
naming file:line), the backbone's GGUF, `--targets` and `--max-len` against the backbone's config
and tokenizer. `--out` is new (`--replace` replaces an existing one) and never an input nor inside
or around one; it is written under a temporary name and renamed into place
(serve_bridge/safe_write.py).
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from argparse import Namespace
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages, imported below

from calibrate.errors import UserError
from calibrate.validate import check_rows_file, task_inputs, validate_task_data
from labeling.backbone import SMOLLM2, BackboneSpec, backbone_source, resolve_backbone_dir
from labeling.tasks import TaskError, build_task
from serve_bridge.command_line import Parser, check_args, fail
from serve_bridge.safe_write import check_output, publish_dir, scratch_dir_for, write_atomic
from serve_bridge.strict_json import StrictJSONError, loads_strict
from serve_bridge.values import OptionError, check_value

EVALUATORS = ("numeric", "restated")
DATA_FIELDS = {"split": (str,), "messages": (list,), "target": (str,), "reference": (str,)}
PREPARE_RULES = {"n_eval": "non_negative_int", "eval_split": ("validation", "test")}
TRAIN_RULES = {"rank": "positive_int", "epochs": "positive_int", "lr": "positive_number", "batch": "positive_int",
               "max_len": "positive_int", "max_new_tokens": "positive_int", "n_eval": "non_negative_int",
               "seed": "seed"}


def _evaluators() -> dict:
    """Evaluator name (recorded per row by ``prepare``) → Q(response, reference)."""
    from labeling.evaluators.numeric import numeric_match
    from labeling.evaluators.restated import restated_match

    return {"numeric": numeric_match, "restated": restated_match}


# --- prepare ------------------------------------------------------------------------------

def prepare(args: Namespace) -> None:
    """Check everything, then write the task's train split and ``--n-eval`` rows of its eval split."""
    check_args(args, PREPARE_RULES)
    try:
        opts = loads_strict(args.task_options) if args.task_options.strip() else {}
    except StrictJSONError as err:
        raise OptionError("--task-options", args.task_options, f"not valid JSON ({err})") from None
    if not isinstance(opts, dict):
        raise OptionError("--task-options", args.task_options, "give a JSON object of task options, e.g. "
                          "'{\"source\": \"/data/gsm8k\"}'")
    try:
        task = build_task(args.task, **opts)
    except OptionError as err:
        raise OptionError("--task-options", args.task_options, f"task {args.task!r}: {err}") from None
    validate_task_data(task)
    out = Path(args.out)
    check_output("--out", out, task_inputs(task), directory=False, replace=args.replace)
    lines = []
    for split, n in (("train", None), (args.eval_split, args.n_eval)):
        for ex in task.load_split(split)[:n]:
            if "solution" not in ex.meta:
                raise TaskError(f"task {args.task!r} has no worked solutions to train on; prepare a task whose "
                                f"examples have one (arith, counter, gsm8k).")
            lines.append(json.dumps({"split": split, "messages": task.messages(ex), "target": ex.meta["solution"],
                                     "reference": ex.reference, "evaluator": args.evaluator}) + "\n")
    write_atomic(out, "".join(lines))
    print(f"wrote {out}")


# --- train --------------------------------------------------------------------------------

def data_row_problem(row: dict[str, Any]) -> str | None:
    """What is wrong with a row of ``--data`` beyond its fields' types, or None."""
    messages = row["messages"]
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in messages):
        return "field 'messages' must be a non-empty list of {role, content} string objects"
    if row.get("evaluator", "numeric") not in EVALUATORS:
        return f"field 'evaluator' is {row['evaluator']!r}; use one of {list(EVALUATORS)}"
    return None


def check_train(args: Namespace) -> tuple[BackboneSpec, list[dict[str, Any]], list[str]]:
    """Check every argument and input of ``train`` before any model loads (module doc); return the
    backbone, the data rows and the target module names."""
    check_args(args, TRAIN_RULES)
    targets = [t.strip() for t in args.targets.split(",")]
    check_value("--targets", targets, "texts")
    data = Path(args.data)
    if not data.is_file():
        raise OptionError("--data", args.data, "not a file; give the JSONL that `prepare` wrote")
    rows = check_rows_file("scripts/train_adapter.py train", data, DATA_FIELDS, data_row_problem)
    if not any(r["split"] == "train" for r in rows):
        raise OptionError("--data", args.data, "holds no row with split 'train'")
    spec = SMOLLM2 if not args.gguf_dir else BackboneSpec(**{**SMOLLM2.__dict__, "gguf_dir": args.gguf_dir})
    backbone_source(spec)  # BackboneError naming a GGUF that is not there
    inputs = [data] + ([Path(args.gguf_dir)] if args.gguf_dir else [])
    check_output("--out", Path(args.out), inputs, directory=True, replace=args.replace)
    return spec, rows, targets


def check_against_backbone(spec: BackboneSpec, targets: list[str], max_new_tokens: int) -> None:
    """``--targets`` name linear modules of the backbone and ``--max-new-tokens`` fits its context,
    from its config alone (the model is built on the meta device; no weights are read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_backbone_dir(spec))
    with torch.device("meta"):
        names = {name.rsplit(".", 1)[-1] for name, m in AutoModelForCausalLM.from_config(config).named_modules()
                 if isinstance(m, torch.nn.Linear)}
    unknown = [t for t in targets if t not in names]
    if unknown:
        raise OptionError("--targets", ",".join(targets), f"{unknown[0]!r} is no linear module of the backbone; "
                          f"its linear modules: {', '.join(sorted(names))}")
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and max_new_tokens >= context:
        raise OptionError("--max-new-tokens", max_new_tokens, f"use fewer than the backbone's context of {context} "
                          f"tokens")


def train(args: Namespace) -> None:
    spec, rows, targets = check_train(args)
    check_against_backbone(spec, targets, args.max_new_tokens)
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from labeling.backbone import load_backbone, stop_token_ids

    encoder = AutoTokenizer.from_pretrained(resolve_backbone_dir(spec))  # the model's own, before the model loads
    train_rows = [r for r in rows if r["split"] == "train"]
    eval_rows = [r for r in rows if r["split"] != "train"][: args.n_eval]

    def ids(x):
        return list(x if isinstance(x, list) else x["input_ids"])

    def encode(r):
        # The target is the chat template's own assistant turn, end-of-turn marker included,
        # so the adapter learns whatever this tokenizer ends a turn with.
        p = ids(encoder.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True))
        full = ids(encoder.apply_chat_template(r["messages"] + [{"role": "assistant", "content": r["target"]}],
                                               tokenize=True))
        if full[:len(p)] != p:
            raise ValueError("chat template: the prompt is not a prefix of prompt + answer; cannot mask the prompt")
        return p, full[len(p):]

    enc = [(p, t) for p, t in map(encode, train_rows) if len(p) + len(t) <= args.max_len]
    if not enc:
        raise OptionError("--max-len", args.max_len, f"every one of the {len(train_rows)} train rows is longer; "
                          f"raise --max-len")

    evaluators = _evaluators()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_backbone(spec, device=dev)
    stops = sorted(stop_token_ids(model.generation_config, tok, spec))

    def evaluate(m, tag):
        m.eval()
        correct, bs = 0, 64
        for i in range(0, len(eval_rows), bs):
            chunk = eval_rows[i:i + bs]
            prompts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in chunk]
            batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(dev)
            with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                out = m.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=stops)
            for r, o in zip(chunk, out[:, batch["input_ids"].shape[1]:]):
                score = evaluators[r.get("evaluator", "numeric")]
                correct += score(tok.decode(o, skip_special_tokens=True), r["reference"])
        acc = 100.0 * correct / max(1, len(eval_rows))
        print(f"[{tag}] greedy accuracy on {len(eval_rows)} eval rows: {acc:.1f}%", flush=True)
        return acc

    base_acc = evaluate(model, "backbone") if args.eval_base else None
    cfg = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.05, target_modules=targets,
                     task_type="CAUSAL_LM")
    model = get_peft_model(model, cfg)
    model.print_trainable_parameters()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    steps = args.epochs * math.ceil(len(enc) / args.batch)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    step, t0 = 0, time.time()
    for epoch in range(args.epochs):
        random.shuffle(enc)
        model.train()
        for i in range(0, len(enc), args.batch):
            chunk = enc[i:i + args.batch]
            n = max(len(p) + len(t) for p, t in chunk)
            input_ids = torch.full((len(chunk), n), tok.pad_token_id, dtype=torch.long)
            labels = torch.full((len(chunk), n), -100, dtype=torch.long)
            mask = torch.zeros((len(chunk), n), dtype=torch.long)
            for j, (p, t) in enumerate(chunk):
                seq = p + t
                input_ids[j, :len(seq)] = torch.tensor(seq)
                labels[j, len(p):len(seq)] = torch.tensor(t)
                mask[j, :len(seq)] = 1
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                loss = model(input_ids=input_ids.to(dev), attention_mask=mask.to(dev), labels=labels.to(dev)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); sched.step(); opt.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0 or step == steps:
                print(f"epoch {epoch} step {step}/{steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
    lora_acc = evaluate(model, "full LoRA")
    out = Path(args.out)
    scratch = scratch_dir_for(out)
    model.save_pretrained(scratch)
    f = scratch / "adapter_model.safetensors"
    save_file({k: v.to(torch.float16).contiguous() for k, v in load_file(f).items()}, f)
    (scratch / "TRAINING.json").write_text(json.dumps({
        "data": Path(args.data).name, "rows": len(enc), "rank": args.rank, "targets": args.targets,
        "epochs": args.epochs, "lr": args.lr, "batch": args.batch, "seed": args.seed, "device": dev,
        "eval_rows": len(eval_rows), "eval_accuracy_lora": lora_acc, "eval_accuracy_backbone": base_acc,
        "torch": torch.__version__}, indent=2))
    publish_dir(scratch, out)
    print(f"saved {out}")


def parser() -> Parser:
    ap = Parser(prog="scripts/train_adapter.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--task", required=True)
    p.add_argument("--task-options", default="", help="JSON dict of task options, e.g. '{\"source\": \"...\"}'")
    p.add_argument("--eval-split", default="validation")
    p.add_argument("--n-eval", type=int, default=200)
    p.add_argument("--evaluator", default="numeric", choices=EVALUATORS,
                   help="how `train` scores its eval rows (restated: '#### N' then 'The answer is N.')")
    p.add_argument("--out", required=True)
    p.add_argument("--replace", action="store_true", help="replace an existing --out file")
    t = sub.add_parser("train")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--replace", action="store_true", help="replace an existing --out directory")
    t.add_argument("--gguf-dir", default="")
    t.add_argument("--rank", type=int, default=8)
    t.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--max-len", type=int, default=512)
    t.add_argument("--max-new-tokens", type=int, default=64)
    t.add_argument("--n-eval", type=int, default=200)
    t.add_argument("--eval-base", action="store_true")
    t.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        prepare(args) if args.cmd == "prepare" else train(args)
    except (OptionError, *UserError) as err:
        fail(str(err))


if __name__ == "__main__":
    main()
