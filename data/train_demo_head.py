"""Train the demo EAGLE-3 head for the bundled demo target, from the target's own hidden states on the demo corpus.

    python data/train_demo_head.py              # full run (resumable; about 15 minutes on two CPU cores)
    python data/train_demo_head.py --resume     # continue an interrupted run from runs/demo-head/
    python data/train_demo_head.py --smoke      # a few steps on a tiny target, for tests

Corpus: the demo pair's training split (data/models/split.json: the Python standard library's sources, each file
`<bos> bytes <eos>`). The head reads the target's hidden states entering layers 1, 3 and 5 (low, middle, high) and
drafts over the DRAFT_VOCAB most frequent tokens of the corpus (a draft vocabulary smaller than the target's, mapped
by d2t as EAGLE-3 heads are). Training unrolls TTT_STEPS drafting steps as EAGLE-3 does: step 1 reads the target's
features, each later step the head's own output at the position before, every step fed the true next token;
step s at position i attends to step 1's entries up to i and to its own earlier steps' entries at i (what the
runtime's cache holds when it drafts). The loss at every step is the cross-entropy of the head's draft-vocabulary
distribution against the target's next-token distribution there (distillation). Export: the `speculators` format
(runtime.heads.save_head), float16, to data/models/demo-head.
"""
from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specbatch.data.train_demo_pair import (BOS, CONTEXT_LEN, EOS, TARGET, VOCAB_SIZE, batches, learning_rate,
                                            split_of, token_stream)
from specbatch.perfmodel.jsonio import atomic_output, write_text_atomic
from specbatch.runtime.checkpoint import build_model, load_checkpoint
from specbatch.runtime.heads import DraftHead, save_head
from specbatch.runtime.heads.config import head_config_from_dict
from specbatch.runtime.model import _rotate, rope_tables

ROOT = Path(__file__).resolve().parent.parent
SPLIT = ROOT / "data" / "models" / "split.json"
FEATURE_LAYERS = (1, 3, 5)  # the residual stream entering these target layers (of 6)
DRAFT_VOCAB = 192  # of the target's 259 ids: the corpus's most frequent bytes and the special tokens it uses
TTT_STEPS = 3


def head_config(target_config, draft_vocab: int, layers=FEATURE_LAYERS):
    """The demo head's config: one layer of the target's width (a narrower MLP), the speculators' EAGLE-3 fields."""
    layer = {"model_type": "llama", "vocab_size": target_config.vocab_size, "hidden_size": target_config.hidden_size,
             "intermediate_size": target_config.intermediate_size * 3 // 4,
             "num_attention_heads": target_config.num_heads,
             "num_key_value_heads": target_config.num_kv_heads, "head_dim": target_config.head_dim,
             "max_position_embeddings": target_config.max_position_embeddings, "rms_norm_eps": target_config.norm_eps,
             "rope_parameters": {"rope_theta": target_config.rope_theta, "rope_type": "default"}}
    raw = {"speculators_model_type": "eagle3", "transformer_layer_config": layer, "draft_vocab_size": draft_vocab,
           "eagle_aux_hidden_state_layer_ids": list(layers), "norm_before_residual": True}
    return head_config_from_dict(raw, target_config, "demo head")


def draft_vocabulary(stream: np.ndarray, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the stream (BOS and EOS always in), ascending: the head's draft ids."""
    counts = np.bincount(stream.astype(np.int64), minlength=VOCAB_SIZE).astype(float)
    counts[[BOS, EOS]] = np.inf
    chosen = np.sort(np.argsort(-counts, kind="stable")[:size])
    return torch.from_numpy(chosen).long()


def ttt_logits(head: DraftHead, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Draft-vocabulary logits of each unrolled step, (B, T, draft vocab) each. `tokens` (B, T) are x_1..x_T and
    `features` (B, T, F) the target's hidden states at positions 0..T-1: step s at index i reads token x_{i+1+s}
    (teacher forcing; zeros past the end) and predicts x_{i+2+s}."""
    layer, config = head.layers[0], head.head_config.layer
    B, T = tokens.shape
    heads, kv_heads, hd = config.num_heads, config.num_kv_heads, config.head_dim
    hidden = head.project(features)
    keys, values, out = [], [], []
    causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
    diagonal = torch.eye(T, dtype=torch.bool, device=tokens.device)
    for step in range(steps):
        ids = torch.cat([tokens[:, step:], tokens.new_zeros(B, step)], dim=1)
        cos, signed_sin = rope_tables(torch.arange(T, device=tokens.device) + step + head.position_offset,
                                      head.inv_freq, head.rope_attention_factor, hidden.dtype)
        normed = head.hidden_norm(hidden)
        residual = normed if head.head_config.norm_before_residual else hidden
        qkv = layer.qkv(torch.cat([layer.attn_norm(head.embed(ids)), normed], dim=-1))
        q, k, v = qkv.split((heads * hd, kv_heads * hd, kv_heads * hd), dim=-1)
        q = _rotate(q.unflatten(-1, (heads, hd)), cos, signed_sin).transpose(1, 2)  # (B, heads, T, hd)
        k = _rotate(k.unflatten(-1, (kv_heads, hd)), cos, signed_sin).transpose(1, 2)
        keys.append(k)
        values.append(v.unflatten(-1, (kv_heads, hd)).transpose(1, 2))
        mask = torch.cat([causal] + [diagonal] * step, dim=1)  # step 1's entries causally, later steps' own at i
        attended = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask,
                                                  enable_gqa=heads != kv_heads)
        x = residual + layer.o(attended.transpose(1, 2).flatten(-2))
        x = x + layer.mlp(layer.mlp_norm(x))
        out.append(head.draft_logits(x))
        hidden = head.norm(x) if head.head_config.norm_output else x
    return out


def train(head: DraftHead, target, stream: np.ndarray, args, run_dir: Path) -> float:
    """Train the head for args.steps; resumable from run_dir/head.pt. Returns the seconds spent."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    params = [p for name, p in head.named_parameters() if not name.startswith("own_embed")]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    state_path, step = run_dir / "head.pt", 0
    if args.resume and state_path.is_file():
        saved = torch.load(state_path, map_location="cpu", weights_only=False)
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
        rng.bit_generator.state = saved["rng"]
        step = saved["step"]
    draft_ids = head.draft_to_target
    data = batches(stream, args.batch_size, args.seq_len, rng)
    started = time.perf_counter()
    with Progress(TextColumn("[bold]head"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                  TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn(),
                  disable=args.quiet) as progress:
        task = progress.add_task("head", total=args.steps, completed=step, loss=float("nan"))
        while step < args.steps:
            window = next(data)  # (B, seq_len + 1): x_0..x_T
            with torch.no_grad():
                target_logits, features = target(window[:, :-1], None, features=FEATURE_LAYERS)
                target_p = target_logits.float().softmax(-1)[..., draft_ids]  # (B, T, draft vocab)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args.steps, args.lr)
            steps_logits = ttt_logits(head, window[:, 1:], features, TTT_STEPS)
            loss = 0.0
            for s, logits in enumerate(steps_logits):  # step s at index i predicts the target's token after i + 1 + s
                usable = args.seq_len - 1 - s
                logq = F.log_softmax(logits[:, :usable].float(), dim=-1)
                loss = loss + 0.8 ** s * -(target_p[:, 1 + s:1 + s + usable] * logq).sum(-1).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            progress.update(task, completed=step, loss=float(loss.detach()))
            if step % 100 == 0 or step == args.steps:
                with atomic_output(state_path) as temporary:
                    torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(),
                                "rng": rng.bit_generator.state, "step": step}, temporary)
    return time.perf_counter() - started


def training_stream(stdlib: Path, smoke: bool) -> np.ndarray:
    """The demo pair's training split, as recorded in split.json (checked against the path-hash rule)."""
    files = json.loads(SPLIT.read_text())["files"]["train"]
    wrong = [f for f in files if split_of(f) != "train"]
    if wrong:
        raise SystemExit(f"{SPLIT}: {len(wrong)} files are not in the train split by the hash rule, e.g. {wrong[0]}")
    present = [f for f in files if (stdlib / f).is_file()]
    if not present:
        raise SystemExit(f"--stdlib {stdlib}: none of the training files of {SPLIT} are there")
    return token_stream(stdlib, present[:6] if smoke else present)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--target", type=Path, default=ROOT / "data" / "models" / "demo-target")
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "models" / "demo-head")
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "demo-head")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=CONTEXT_LEN // 4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="a tiny random target, 5 steps (for tests)")
    args = parser.parse_args(argv)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    stream = training_stream(args.stdlib, args.smoke)
    if args.smoke:
        args.steps, args.batch_size, args.seq_len = 5, 2, 32
        config = replace(TARGET, hidden_size=32, num_heads=2, num_kv_heads=2, head_dim=16, intermediate_size=64)
        target = build_model(config, seed=0)
    else:
        target = load_checkpoint(args.target, "cpu", torch.float32, role="target").model
    for param in target.parameters():
        param.requires_grad_(False)
    head = DraftHead(head_config(target.config, DRAFT_VOCAB), target)
    head.draft_to_target = draft_vocabulary(stream, DRAFT_VOCAB)
    for name, param in head.named_parameters():
        if param.dim() > 1:
            torch.nn.init.normal_(param, std=0.02 / (math.sqrt(2) if name.endswith(("o.weight", "down.weight")) else 1))
    seconds = train(head, target, stream, args, args.run_dir)
    head.eval()
    save_head(head, args.out, verifier="demo-target", dtype=torch.float16, speculative_tokens=TTT_STEPS)
    report = {"head_parameters": sum(p.numel() for p in head.parameters()), "draft_vocab_size": DRAFT_VOCAB,
              "feature_layers": list(FEATURE_LAYERS), "ttt_steps": TTT_STEPS, "steps": args.steps,
              "train_tokens": args.steps * args.batch_size * args.seq_len, "train_seconds": seconds,
              "torch_threads": torch.get_num_threads()}
    write_text_atomic(args.run_dir / "report.json", json.dumps(report, indent=2) + "\n")
    if not args.quiet:
        print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
