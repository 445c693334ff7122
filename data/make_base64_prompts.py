"""Write data/prompts/base64.jsonl: prompts on which the demo draft agrees with the target much less.

The demo pair was trained on the Python standard library (data/train_demo_pair.py); what its draft cannot
predict is the target's next byte inside high-entropy data. Each prompt is the first 48 characters of a
base64 body line of a CA certificate under /etc/ssl/certs (Debian's ca-certificates), taken at a quarter,
a half and three quarters of each distinct certificate's body, in sorted file order (the first 300).

    python data/make_base64_prompts.py             # writes data/prompts/base64.jsonl (300 prompts)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

CERT_DIR = Path("/etc/ssl/certs")
OUT = Path(__file__).resolve().parent / "prompts" / "base64.jsonl"
PROMPT_CHARS = 48


def body_lines(pem_text: str) -> list[str]:
    """The base64 lines between BEGIN and END of the first certificate in a PEM file."""
    lines = pem_text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("-----BEGIN"))
        end = next(i for i, line in enumerate(lines) if line.startswith("-----END"))
    except StopIteration:
        return []
    return [line for line in lines[start + 1:end] if len(line) >= PROMPT_CHARS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=300)
    args = parser.parse_args()
    seen, prompts = set(), []
    for path in sorted(CERT_DIR.glob("*.pem")):
        body = body_lines(path.read_text(errors="replace"))
        if len(body) < 3 or body[0] in seen:  # the same certificate under another name
            continue
        seen.add(body[0])
        prompts += [body[i * len(body) // 4][:PROMPT_CHARS] for i in (1, 2, 3)]
    if len(prompts) < args.count:
        raise SystemExit(f"only {len(prompts)} prompts found under {CERT_DIR}; need {args.count}")
    OUT.write_text("".join(json.dumps(p) + "\n" for p in prompts[:args.count]))
    print(f"wrote {args.count} prompts to {OUT}")


if __name__ == "__main__":
    main()
