"""Train the bundled demo mixture-of-experts target: a byte-level Qwen3-MoE model on the demo pair's corpus, with
the demo pair's tokenizer (so data/models/demo-draft drafts for it).

    python data/train_demo_moe.py               # full run (resumable; about 25 minutes on one CPU thread)
    python data/train_demo_moe.py --resume      # continue an interrupted run from runs/demo-moe/
    python data/train_demo_moe.py --smoke       # 20 steps of a tiny model on a tiny corpus, for tests

Corpus, split, batches, learning-rate schedule, bits-per-byte evaluation and tokenizer are train_demo_pair's
(imported, not copied): the Python standard library's sources split by file, each file `<bos> bytes <eos>`.
The model is our runtime's own CausalLM built from the exported config.json (`qwen3_moe`: softmax top-k routing
with norm_topk_prob, per-head q/k norms), trained on next-byte cross-entropy plus the Switch Transformer
load-balancing loss of every expert layer (N * sum_e f_e * P_e: f_e the share of the layer's top-k assignments
that go to expert e, P_e its mean router probability; k at perfect balance, so `--aux-coef` is on
transformers' `router_aux_loss_coef` scale), averaged over the layers. Export: a Hugging Face directory in the
Hub's per-expert layout (`mlp.experts.j.gate_proj` ..., `mlp.gate`), float16, the inverse of the runtime
loader's own weight plan. The report measures bits per byte on validation and held-out text (and demo-target's
on the same windows), and how the router spreads held-out tokens over the experts.
"""
from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specbatch.data.train_demo_pair import (BOS, CONTEXT_LEN, EOS, PAD, VOCAB_SIZE, batches, bits_per_byte,
                                            byte_tokenizer_json, learning_rate, stdlib_files, token_stream)
from specbatch.perfmodel.jsonio import atomic_output, write_text_atomic
from specbatch.runtime.checkpoint import load_checkpoint, weight_placements
from specbatch.runtime.config import ModelConfig, config_from_dict
from specbatch.runtime.model import CausalLM

ROOT = Path(__file__).resolve().parent.parent  # the package directory (the repository root in a checkout)

# 16 experts of width 96, top-2, in 4 layers of width 256: 5.85M parameters (11.7 MB in float16), of which a
# token runs 1.7M; the expert width is what keeps the file under 12 MB (16 x 128 would make 14.8 MB)
SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
             num_experts=16, num_experts_per_tok=2, moe_intermediate_size=96)
SMOKE_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
USED_SHARE = 0.01  # an expert counts as used in a layer when it takes at least 1 % of the layer's assignments


def hf_config(shape: dict, aux_coef: float) -> dict:
    """The exported config.json: Qwen3MoeConfig's fields, every layer routed."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": VOCAB_SIZE,
        **shape, "intermediate_size": shape["moe_intermediate_size"], "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "router_aux_loss_coef": aux_coef, "output_router_logits": False,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": True, "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
        "torch_dtype": "float16", "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
    }


class RouterTap:
    """Keeps every expert layer's router logits (tokens, experts) of the passes run while it is attached."""

    def __init__(self, model: CausalLM):
        self.logits: list[torch.Tensor] = []
        self.handles = [layer.experts.router.register_forward_hook(lambda _m, _i, out: self.logits.append(out))
                        for layer in model.layers if layer.experts is not None]

    def take(self) -> list[torch.Tensor]:
        logits, self.logits = self.logits, []
        return logits

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss per layer, N * sum_e f_e * P_e (f_e: the share of the layer's top-k
    assignments going to expert e, times k; P_e: expert e's mean router probability), averaged over layers."""
    losses = []
    for logits in router_logits:
        probabilities = torch.softmax(logits.float(), dim=-1)
        experts = logits.shape[-1]
        chosen = probabilities.topk(top_k, dim=-1).indices
        counts = torch.zeros(experts, device=logits.device).scatter_add_(
            0, chosen.flatten(), torch.ones(chosen.numel(), device=logits.device))
        losses.append(experts * (counts / logits.shape[0] * probabilities.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def expert_loads(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """(layers, experts) assignment counts."""
    return torch.stack([torch.bincount(logits.topk(top_k, dim=-1).indices.flatten(), minlength=logits.shape[-1])
                        for logits in router_logits]).cpu()


def init_weights(model: CausalLM, config: ModelConfig) -> None:
    """train_demo_pair's initialisation (normal 0.02; residual outputs scaled by 1/sqrt(2 layers)), the stacked
    experts' down projections counted as residual outputs."""
    for name, param in model.named_parameters():
        if param.dim() > 1:
            residual_out = name.endswith(("o.weight", "down.weight", "experts.down"))
            torch.nn.init.normal_(param, std=0.02 / (math.sqrt(2 * config.num_layers) if residual_out else 1))


def train(config: ModelConfig, stream: np.ndarray, run_dir: Path, args) -> tuple[CausalLM, float]:
    """Train for args.steps; resumable from run_dir/moe.pt (saved every 50 steps); progress in run_dir/log.jsonl."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = CausalLM(config).to(device)
    init_weights(model, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(args.seed)
    state_path, log_path = run_dir / "moe.pt", run_dir / "log.jsonl"
    step, seconds = 0, 0.0
    if args.resume and state_path.is_file():
        saved = torch.load(state_path, map_location=device, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        rng.bit_generator.state = saved["rng"]
        step, seconds = saved["step"], saved.get("seconds", 0.0)
    elif log_path.exists():
        log_path.unlink()
    data = batches(stream, args.batch_size, args.seq_len, rng)
    tap = RouterTap(model)
    model.train()
    window_loss, window_aux, window_load, started = 0.0, 0.0, None, time.perf_counter()
    while step < args.steps:
        batch = next(data).to(device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, warmup=min(100, args.steps // 5))
        logits = model(inputs)
        router_logits = tap.take()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))
        aux = load_balancing_loss(router_logits, config.experts_per_token)
        optimizer.zero_grad(set_to_none=True)
        (loss + args.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        window_loss += loss.item()
        window_aux += aux.item()
        load = expert_loads([x.detach() for x in router_logits], config.experts_per_token)
        window_load = load if window_load is None else window_load + load
        if step % args.log_every == 0 or step == args.steps:
            now = time.perf_counter()
            seconds += now - started
            count = (step - 1) % args.log_every + 1
            share = window_load / window_load.sum(dim=1, keepdim=True)
            record = {"step": step, "loss": window_loss / count,
                      "bits_per_byte_train": window_loss / count / math.log(2), "aux": window_aux / count,
                      "seconds": round(seconds, 1),
                      "experts_used": (share >= USED_SHARE).sum(dim=1).tolist(),
                      "max_share": [round(x, 3) for x in share.max(dim=1).values.tolist()]}
            with open(log_path, "a") as log:
                log.write(json.dumps(record) + "\n")
            if not args.quiet:
                print(json.dumps(record), flush=True)
            window_loss, window_aux, window_load, started = 0.0, 0.0, None, now
            if step % 50 == 0 or step == args.steps:
                with atomic_output(state_path) as temporary:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "rng": rng.bit_generator.state, "step": step, "seconds": seconds}, temporary)
    tap.close()
    model.eval()
    return model, seconds


# ---------------------------------------------------------------- export
def internal_to_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict in the Hub's layout: the runtime loader's plan (runtime.checkpoint.weight_placements), run
    backwards (each Hugging Face tensor is its placement's slice of our parameter)."""
    out = {}
    for name, placement in weight_placements(config).items():
        tensor = state[placement.name]
        if placement.expert is not None:
            tensor = tensor[placement.expert]
        if placement.start is not None:
            tensor = tensor[placement.start:placement.start + placement.rows]
        if placement.transpose:
            tensor = tensor.t()
        out[name if name == "lm_head.weight" else "model." + name] = tensor.contiguous()
    return out


def export(model: CausalLM, raw_config: dict, directory: Path) -> None:
    """A Hugging Face model directory laid out as demo-target's (train_demo_pair.export), for qwen3_moe."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    tensors = {k: v.to(torch.float16) for k, v in internal_to_hf(state, model.config).items()}
    with atomic_output(directory / "model.safetensors") as temporary:
        save_file(tensors, str(temporary), metadata={"format": "pt"})
    write_text_atomic(directory / "config.json", json.dumps(raw_config, indent=2) + "\n")
    write_text_atomic(directory / "generation_config.json",
                      json.dumps({"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}, indent=2) + "\n")
    write_text_atomic(directory / "tokenizer.json", byte_tokenizer_json())
    write_text_atomic(directory / "tokenizer_config.json", json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "model_max_length": raw_config["max_position_embeddings"]}, indent=2) + "\n")


# ---------------------------------------------------------------- routing on held-out text
@torch.no_grad()
def routing_report(model: CausalLM, stream: np.ndarray, windows: int, seq_len: int, device,
                   spans: tuple[int, ...] = (4, 8, 64)) -> dict:
    """How the router spreads held-out tokens: per layer, the experts taking >= USED_SHARE of the assignments,
    the largest and smallest shares, the effective number of experts (exp of the load's entropy), and how many
    distinct experts a span of n consecutive tokens of one text touches, against the same count for n tokens
    drawn at random from all the windows (routing with no locality)."""
    tap = RouterTap(model)
    rng = np.random.default_rng(4321)
    chosen_by_layer: list[list[torch.Tensor]] = []
    done = 0
    for batch in batches(stream, 8, seq_len, rng):
        model(batch[:, :-1].to(device))
        for layer, logits in enumerate(tap.take()):
            if len(chosen_by_layer) <= layer:
                chosen_by_layer.append([])
            chosen_by_layer[layer].append(
                logits.topk(model.config.experts_per_token, dim=-1).indices.view(8, seq_len, -1).cpu())
        done += 8
        if done >= windows:
            break
    tap.close()
    experts = model.config.num_experts
    report: dict = {"tokens": done * seq_len, "used_share": USED_SHARE, "layers": []}
    shuffle = torch.Generator().manual_seed(0)
    for chosen in chosen_by_layer:
        chosen = torch.cat(chosen)  # (windows, seq_len, k)
        share = torch.bincount(chosen.flatten(), minlength=experts).double()
        share /= share.sum()
        entropy = -(share[share > 0] * share[share > 0].log()).sum().item()
        layer = {"experts_used": int((share >= USED_SHARE).sum()), "experts_touched": int((share > 0).sum()),
                 "max_share": round(share.max().item(), 4), "min_share": round(share.min().item(), 4),
                 "effective_experts": round(math.exp(entropy), 2), "distinct_experts_per_span": {}}
        flat = chosen.reshape(-1, chosen.shape[-1])
        for n in spans:
            spans_of_text = chosen[:, :seq_len // n * n].reshape(chosen.shape[0], -1, n * chosen.shape[-1])
            random_tokens = flat[torch.randperm(flat.shape[0], generator=shuffle)][:flat.shape[0] // n * n]
            layer["distinct_experts_per_span"][str(n)] = {
                "text": round(_distinct(spans_of_text.reshape(-1, n * chosen.shape[-1]), experts), 2),
                "random": round(_distinct(random_tokens.reshape(-1, n * chosen.shape[-1]), experts), 2)}
        report["layers"].append(layer)
    return report


def _distinct(groups: torch.Tensor, experts: int) -> float:
    """Mean number of distinct experts per row of `groups` (rows of expert ids)."""
    hits = torch.zeros(groups.shape[0], experts, dtype=torch.bool).scatter_(1, groups, True)
    return hits.sum(dim=1).double().mean().item()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "models" / "demo-moe")
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "demo-moe")
    parser.add_argument("--reference", type=lambda s: Path(s) if s else None,
                        default=ROOT / "data" / "models" / "demo-target",
                        help="a model scored on the same evaluation windows ('' for none)")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=CONTEXT_LEN)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--aux-coef", type=float, default=0.01,
                        help="weight of the load-balancing loss (transformers' router_aux_loss_coef scale)")
    parser.add_argument("--eval-windows", type=int, default=128)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 20 steps on a tiny corpus (for tests)")
    args = parser.parse_args(argv)
    shape = SHAPE
    if args.smoke:
        args.steps, args.batch_size, args.seq_len, args.eval_windows, args.log_every = 20, 2, 64, 16, 5
        args.reference = None
        shape = SMOKE_SHAPE
    raw_config = hf_config(shape, args.aux_coef)
    config = config_from_dict(raw_config, "demo-moe config")
    args.run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    splits = stdlib_files(args.stdlib)
    if args.smoke:
        splits = {name: files[:6] for name, files in splits.items()}
    streams = {name: token_stream(args.stdlib, files) for name, files in splits.items()}
    model, train_seconds = train(config, streams["train"], args.run_dir, args)
    export(model, raw_config, args.out)

    # everything below reads the exported (float16) weights back through the runtime's loader
    exported = load_checkpoint(args.out, device=args.device, dtype=torch.float32)
    models = {"demo-moe": exported.model}
    if args.reference:
        models["reference"] = load_checkpoint(args.reference, device=args.device, dtype=torch.float32).model
    scores = {name: {split: bits_per_byte(m, streams[split], args.eval_windows, args.seq_len, args.device)
                     for split in ("validation", "heldout")} for name, m in models.items()}
    report = {
        "config": {k: raw_config[k] for k in (*shape, "norm_topk_prob")},
        "parameters": config.parameter_count(),
        "active_parameters_per_token": config.parameter_count() - config.num_layers * (
            config.num_experts - config.experts_per_token) * 3 * config.hidden_size * config.expert_intermediate_size,
        "file_bytes": (args.out / "model.safetensors").stat().st_size,
        "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "aux_coef": args.aux_coef,
        "train_tokens": args.steps * args.batch_size * args.seq_len,
        "train_seconds": round(train_seconds, 1),
        "bits_per_byte": {"demo-moe": scores["demo-moe"]},
        "routing_heldout": routing_report(exported.model, streams["heldout"], args.eval_windows, args.seq_len,
                                          args.device),
        "files": {name: len(files) for name, files in splits.items()},
        "torch_threads": torch.get_num_threads(),
    }
    if args.reference:
        report["bits_per_byte"][args.reference.name] = scores["reference"]
    report["total_seconds"] = round(time.perf_counter() - started, 1)
    write_text_atomic(args.run_dir / "report.json", json.dumps(report, indent=2) + "\n")
    if not args.quiet:
        print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
