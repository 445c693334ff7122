"""Train the bundled demo pair: a byte-level Llama-family target and a distilled draft, on the
Python standard library's own sources.

    python data/train_demo_pair.py                  # full run (resumable; under an hour on two CPU cores)
    python data/train_demo_pair.py --resume         # continue an interrupted run from runs/demo/
    python data/train_demo_pair.py --smoke          # 20 steps each on a tiny corpus, for tests

Stages: split the corpus by file (sha1 of the path relative to the stdlib root mod 100: < 90 train, < 95
validation, else held-out, the same on any Python version), write held-out prompts, train the target on
next-byte prediction, distill the draft from its soft labels (KL(p_target || q_draft)), export both as
Hugging Face model directories (float16 safetensors, byte-level tokenizer.json), report bits per byte.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import sys
import sysconfig
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specbatch.perfmodel.jsonio import atomic_output, write_text_atomic
from specbatch.runtime.checkpoint import internal_to_hf_llama
from specbatch.runtime.config import ModelConfig
from specbatch.runtime.model import CausalLM

ROOT = Path(__file__).resolve().parent.parent  # the package directory (the repository root in a checkout)

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 259
CONTEXT_LEN = 512

# Sizes chosen to train on a 2-core CPU within the hour; the draft has one layer,
# under 1/10 of the target's parameters, so its batch-1 forward pass is a fraction of the target's.
TARGET = ModelConfig(
    model_type="llama", vocab_size=VOCAB_SIZE, hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=4,
    head_dim=64, intermediate_size=704, max_position_embeddings=1024, norm_eps=1e-5, tie_word_embeddings=True,
    bos_token_id=BOS, eos_token_ids=(EOS,), pad_token_id=PAD,
)
DRAFT = replace(TARGET, hidden_size=192, num_layers=1, num_heads=3, num_kv_heads=3, intermediate_size=480)


# ---------------------------------------------------------------- corpus and split
def split_of(relative_path: str) -> str:
    bucket = int(hashlib.sha1(relative_path.encode()).hexdigest(), 16) % 100
    return "train" if bucket < 90 else "validation" if bucket < 95 else "heldout"


def stdlib_files(root: Path) -> dict[str, list[str]]:
    splits: dict[str, list[str]] = {"train": [], "validation": [], "heldout": []}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if "site-packages" in relative or "dist-packages" in relative:
            continue
        splits[split_of(relative)].append(relative)
    return splits


def token_stream(root: Path, files: list[str]) -> np.ndarray:
    """All files' bytes, each wrapped in BOS ... EOS, as one int16 array of token ids."""
    parts = []
    for relative in files:
        data = np.frombuffer((root / relative).read_bytes(), dtype=np.uint8).astype(np.int16)
        parts.append(np.concatenate([[BOS], data, [EOS]]).astype(np.int16))
    return np.concatenate(parts)


def held_out_prompts(root: Path, heldout: list[str], seen_text: bytes, limit: int) -> list[str]:
    """A `def` line with its docstring (or the def line and the next line), from held-out files only."""
    prompts: list[str] = []
    for relative in heldout:
        source = (root / relative).read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
                continue
            first = node.body[0]
            has_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                and isinstance(first.value.value, str)
            end = first.end_lineno if has_doc else first.lineno
            text = textwrap.dedent("".join(lines[node.lineno - 1:end]))
            if 30 <= len(text.encode()) <= 400:
                prompts.append(text if text.endswith("\n") else text + "\n")
    prompts = sorted(set(prompts))
    random.Random(0).shuffle(prompts)
    kept: list[str] = []
    for prompt in prompts:  # drop any prompt that also occurs verbatim in a training/validation file
        if prompt.encode() not in seen_text:
            kept.append(prompt)
        if len(kept) == limit:
            break
    return kept


# ---------------------------------------------------------------- training
def batches(stream: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(stream) - seq_len - 1, size=batch_size)
        window = np.stack([stream[s:s + seq_len + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(window)


def learning_rate(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def bits_per_byte(model: CausalLM, stream: np.ndarray, windows: int, seq_len: int, device) -> float:
    rng = np.random.default_rng(1234)
    total, count = 0.0, 0
    for batch in batches(stream, 8, seq_len, rng):
        batch = batch.to(device)
        logits = model(batch[:, :-1]).float()
        targets = batch[:, 1:]
        losses = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1), reduction="none")
        byte_targets = (targets.reshape(-1) < 256)
        total += losses[byte_targets].sum().item()
        count += byte_targets.sum().item()
        windows -= 8
        if windows <= 0:
            break
    return total / count / math.log(2)


def train(role: str, config: ModelConfig, stream: np.ndarray, steps: int, run_dir: Path, args,
          teacher: CausalLM | None = None) -> CausalLM:
    """Train `role` for `steps`; resumable from `run_dir/<role>.pt` (saved every 100 steps)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    device = torch.device(args.device)
    torch.manual_seed(args.seed + (1 if teacher is not None else 0))
    model = CausalLM(config).to(device)
    for name, param in model.named_parameters():
        if param.dim() > 1:
            residual_out = name.endswith(("o.weight", "down.weight"))
            torch.nn.init.normal_(param, std=0.02 / (math.sqrt(2 * config.num_layers) if residual_out else 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(args.seed + (7 if teacher is not None else 0))
    state_path = run_dir / f"{role}.pt"
    step = 0
    if args.resume and state_path.is_file():
        saved = torch.load(state_path, map_location=device, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        rng.bit_generator.state = saved["rng"]
        step = saved["step"]
    data = batches(stream, args.batch_size, args.seq_len, rng)
    model.train()
    started = time.perf_counter()
    with Progress(TextColumn(f"[bold]{role}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                  TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn(),
                  disable=args.quiet) as progress:
        task = progress.add_task(role, total=steps, completed=step, loss=float("nan"))
        while step < steps:
            batch = next(data).to(device)
            inputs, targets = batch[:, :-1], batch[:, 1:]
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, steps, args.lr)
            logits = model(inputs)
            if teacher is None:
                loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))
            else:  # distillation: KL(p_target || q_draft) on every position
                with torch.no_grad():
                    teacher_logp = F.log_softmax(teacher(inputs).float(), dim=-1)
                loss = F.kl_div(F.log_softmax(logits.float(), dim=-1).reshape(-1, VOCAB_SIZE),
                                teacher_logp.reshape(-1, VOCAB_SIZE), log_target=True, reduction="batchmean")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            progress.update(task, completed=step, loss=loss.item())
            if step % 100 == 0 or step == steps:
                with atomic_output(state_path) as temporary:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "rng": rng.bit_generator.state, "step": step}, temporary)
    model.eval()
    model.train_seconds = time.perf_counter() - started
    return model


# ---------------------------------------------------------------- export
def byte_tokenizer_json() -> str:
    """A byte-level tokenizer.json: id b is byte b; 256/257/258 are <bos>/<eos>/<pad>; BOS is prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    byte_to_char, extra = {}, 0
    for byte in range(256):  # the usual reversible byte -> printable-character map of byte-level BPE
        if byte in printable:
            byte_to_char[byte] = chr(byte)
        else:
            byte_to_char[byte] = chr(256 + extra)
            extra += 1
    vocab = {byte_to_char[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<bos>", "<eos>", "<pad>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                             special_tokens=[("<bos>", BOS)])
    return tokenizer.to_str()


def export(model: CausalLM, config: ModelConfig, directory: Path) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    tensors = {k: v.to(torch.float16) for k, v in internal_to_hf_llama(state, config).items()}
    with atomic_output(directory / "model.safetensors") as temporary:
        save_file(tensors, str(temporary), metadata={"format": "pt"})
    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta, "hidden_act": "silu", "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float16",
        "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
    }
    write_text_atomic(directory / "config.json", json.dumps(hf_config, indent=2) + "\n")
    write_text_atomic(directory / "generation_config.json",
        json.dumps({"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}, indent=2) + "\n")
    write_text_atomic(directory / "tokenizer.json", byte_tokenizer_json())
    write_text_atomic(directory / "tokenizer_config.json", json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "model_max_length": config.max_position_embeddings}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--out", type=Path, default=ROOT / "data")
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "demo")
    parser.add_argument("--target-steps", type=int, default=2200)
    parser.add_argument("--draft-steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=CONTEXT_LEN)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny models, 20 steps each (for tests)")
    args = parser.parse_args(argv)
    target_config, draft_config = TARGET, DRAFT
    if args.smoke:
        args.target_steps = args.draft_steps = 20
        args.batch_size, args.seq_len, args.prompts = 2, 64, 20
        target_config = replace(TARGET, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16,
                                intermediate_size=64)
        draft_config = replace(target_config, num_layers=1)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    splits = stdlib_files(args.stdlib)
    if args.smoke:
        splits = {name: files[:6] for name, files in splits.items()}
    streams = {name: token_stream(args.stdlib, files) for name, files in splits.items()}
    seen = b"\0".join((args.stdlib / f).read_bytes() for f in splits["train"] + splits["validation"])
    prompts = held_out_prompts(args.stdlib, splits["heldout"], seen, args.prompts)
    (args.out / "prompts").mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "prompts" / "heldout.jsonl", "".join(json.dumps(p) + "\n" for p in prompts))
    (args.out / "models").mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "models" / "split.json", json.dumps({
        "rule": "sha1(path relative to the stdlib root) mod 100: < 90 train, < 95 validation, else heldout",
        "python": sys.version.split()[0], "files": splits}, indent=1) + "\n")

    target = train("target", target_config, streams["train"], args.target_steps, args.run_dir, args)
    draft = train("draft", draft_config, streams["train"], args.draft_steps, args.run_dir, args, teacher=target)
    for model in (target, draft):
        for param in model.parameters():
            param.requires_grad_(False)
    export(target, target_config, args.out / "models" / "demo-target")
    export(draft, draft_config, args.out / "models" / "demo-draft")
    windows = 16 if args.smoke else 256
    report = {
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "draft_parameters": sum(p.numel() for p in draft.parameters()),
        "target_validation_bits_per_byte": bits_per_byte(target, streams["validation"], windows, args.seq_len,
                                                         args.device),
        "draft_validation_bits_per_byte": bits_per_byte(draft, streams["validation"], windows, args.seq_len,
                                                        args.device),
        "target_train_seconds": getattr(target, "train_seconds", 0.0),
        "draft_train_seconds": getattr(draft, "train_seconds", 0.0),
        "total_seconds": time.perf_counter() - started,
        "train_tokens": {"target": args.target_steps * args.batch_size * args.seq_len,
                         "draft": args.draft_steps * args.batch_size * args.seq_len},
        "files": {name: len(files) for name, files in splits.items()},
        "prompts": len(prompts),
        "torch_threads": torch.get_num_threads(),
    }
    write_text_atomic(args.run_dir / "report.json", json.dumps(report, indent=2) + "\n")
    if not args.quiet:
        print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
