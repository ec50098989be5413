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
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _evaluators() -> dict:
    """Evaluator name (recorded per row by ``prepare``) → Q(response, reference)."""
    from labeling.evaluators.numeric import numeric_match
    from labeling.evaluators.restated import restated_match

    return {"numeric": numeric_match, "restated": restated_match}


def prepare(args: argparse.Namespace) -> None:
    from labeling.tasks import build_task

    opts = json.loads(args.task_options) if args.task_options else {}
    task = build_task(args.task, **opts)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for split, n in (("train", None), (args.eval_split, args.n_eval)):
            rows = task.load_split(split)
            for ex in rows[:n]:
                f.write(json.dumps({"split": split, "messages": task.messages(ex), "target": ex.meta["solution"],
                                    "reference": ex.reference, "evaluator": args.evaluator}) + "\n")
    print(f"wrote {out}")


def train(args: argparse.Namespace) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    from labeling.backbone import SMOLLM2, BackboneSpec, load_backbone, stop_token_ids

    evaluators = _evaluators()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    spec = SMOLLM2 if not args.gguf_dir else BackboneSpec(**{**SMOLLM2.__dict__, "gguf_dir": args.gguf_dir})
    model, tok = load_backbone(spec, device=dev)
    stops = sorted(stop_token_ids(model.generation_config, tok, spec))
    rows = [json.loads(line) for line in open(args.data)]
    train_rows = [r for r in rows if r["split"] == "train"]
    eval_rows = [r for r in rows if r["split"] != "train"][: args.n_eval]

    def ids(x):
        return list(x if isinstance(x, list) else x["input_ids"])

    def encode(r):
        # The target is the chat template's own assistant turn, end-of-turn marker included,
        # so the adapter learns whatever this tokenizer ends a turn with.
        p = ids(tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True))
        full = ids(tok.apply_chat_template(r["messages"] + [{"role": "assistant", "content": r["target"]}], tokenize=True))
        if full[:len(p)] != p:
            raise ValueError("chat template: the prompt is not a prefix of prompt + answer; cannot mask the prompt")
        return p, full[len(p):]

    enc = [encode(r) for r in train_rows]
    enc = [(p, t) for p, t in enc if len(p) + len(t) <= args.max_len]

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
    cfg = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.05,
                     target_modules=args.targets.split(","), task_type="CAUSAL_LM")
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
            ids = torch.full((len(chunk), n), tok.pad_token_id, dtype=torch.long)
            labels = torch.full((len(chunk), n), -100, dtype=torch.long)
            mask = torch.zeros((len(chunk), n), dtype=torch.long)
            for j, (p, t) in enumerate(chunk):
                seq = p + t
                ids[j, :len(seq)] = torch.tensor(seq)
                labels[j, len(p):len(seq)] = torch.tensor(t)
                mask[j, :len(seq)] = 1
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                loss = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), labels=labels.to(dev)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); sched.step(); opt.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0 or step == steps:
                print(f"epoch {epoch} step {step}/{steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
    lora_acc = evaluate(model, "full LoRA")
    out = Path(args.out)
    model.save_pretrained(out)
    f = out / "adapter_model.safetensors"
    save_file({k: v.to(torch.float16).contiguous() for k, v in load_file(f).items()}, f)
    (out / "TRAINING.json").write_text(json.dumps({
        "data": Path(args.data).name, "rows": len(enc), "rank": args.rank, "targets": args.targets,
        "epochs": args.epochs, "lr": args.lr, "batch": args.batch, "seed": args.seed, "device": dev,
        "eval_rows": len(eval_rows), "eval_accuracy_lora": lora_acc, "eval_accuracy_backbone": base_acc,
        "torch": torch.__version__}, indent=2))
    print(f"saved {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--task", required=True)
    p.add_argument("--task-options", default="", help="JSON dict of task options, e.g. '{\"source\": \"...\"}'")
    p.add_argument("--eval-split", default="validation")
    p.add_argument("--n-eval", type=int, default=200)
    p.add_argument("--evaluator", default="numeric", choices=("numeric", "restated"),
                   help="how `train` scores its eval rows (restated: '#### N' then 'The answer is N.')")
    p.add_argument("--out", required=True)
    t = sub.add_parser("train")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
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
    args = ap.parse_args()
    prepare(args) if args.cmd == "prepare" else train(args)


if __name__ == "__main__":
    main()
