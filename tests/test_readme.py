"""The README's promises: its two set-up commands (one plain install line each; the test one byte for byte
what .ci/run runs), its length, the files it shows, and its A100 picture's claim, which its own commands
reproduce from the repository's copy of vidur's published timings."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SPECBATCH = Path(sys.executable).parent / "specbatch"
MAX_WORDS = 1000


def bash_blocks() -> list[list[str]]:
    """Every ```bash block of the README, as its lines, backslash continuations joined."""
    blocks = re.findall(r"^```bash\n(.*?)^```", README, flags=re.MULTILINE | re.DOTALL)
    return [block.replace("\\\n", " ").splitlines() for block in blocks]


def test_the_readme_opens_with_the_demo_and_the_test_commands_one_install_line_each():
    demo, tests = bash_blocks()[:2]
    assert demo[-1] == "specbatch demo" and tests[-1] == "python -m pytest -q"
    for block in (demo, tests):
        assert [line for line in block if line.startswith("pip install")] == [block[-2]]
        assert not any("&&" in line for line in block)  # plain lines, nothing fused


def test_ci_runs_the_readme_test_command_byte_for_byte():
    tests = bash_blocks()[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    starts = [i for i, line in enumerate(ci) if line == tests[0]]
    assert any(ci[i:i + len(tests)] == tests for i in starts), f".ci/run does not run {tests} in sequence"


def test_the_readme_is_at_most_a_thousand_words():
    assert len(README.split()) <= MAX_WORDS  # as `wc -w` counts


def test_the_readme_generate_prompt_is_within_the_default_tables_contexts():
    """The first everyday command printed 'context length 19 is outside the buckets [38, ...]': a table's
    smallest bucket is the shortest context its profile measured (the in-situ steps' prompts), and the note
    was right. The README's prompt is as long as that, on the demo profile."""
    import shlex

    from specbatch.perfmodel.profile import load_profile
    from specbatch.runtime.assembly import DEMO_TARGET
    from specbatch.runtime.checkpoint import load_tokenizer

    command = next(shlex.split(line, comments=True) for block in bash_blocks() for line in block
                   if line.startswith("specbatch generate --prompt"))
    prompt = command[command.index("--prompt") + 1]
    profile = load_profile(ROOT / "data" / "profiles" / "demo-cpu.json")
    shortest = min(row.context_len for rows in (profile.timings, profile.insitu_timings) for row in rows)
    assert len(load_tokenizer(DEMO_TARGET).encode(prompt)) >= shortest


def test_every_picture_and_local_link_of_the_readme_exists():
    targets = re.findall(r"\]\(([^)#]+)\)", README)
    local = [target for target in targets if not target.startswith(("http://", "https://"))]
    assert "docs/img/best-k-a100.png" in local
    assert [target for target in local if not (ROOT / target).exists()] == []


def test_the_a100_commands_give_the_best_k_the_readme_states(tmp_path):
    """The README's block of `--from-vidur` commands, run verbatim in a folder that sees the repository's
    tests/ and data/: the table's best k at the two batch sizes the text names, at the picture's context,
    are the ones it states."""
    (commands,) = [block for block in bash_blocks() if any("--from-vidur" in line for line in block)]
    for name in ("tests", "data"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "docs" / "img").mkdir(parents=True)
    for line in commands:
        program, *args = line.split()
        assert program == "specbatch", line
        done = subprocess.run([str(SPECBATCH), *args], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{line}: {done.stderr}"
    assert (tmp_path / "docs" / "img" / "best-k-a100.png").stat().st_size > 0

    stated = re.search(r"best k falls from (\d+) at b = (\d+) to (\d+) at b = (\d+)", README)
    assert stated, "the README no longer states the A100 picture's claim"
    k_small, b_small, k_large, b_large = map(int, stated.groups())
    table = json.loads(next(tmp_path.glob("*.table.json")).read_text())
    (context_len,) = re.findall(r"--context-len (\d+)", " ".join(commands))  # the picture's
    (bucket,) = [bucket for bucket in table["buckets"] if bucket["context_len"] == int(context_len)]
    best_k = {entry["batch_size"]: entry["k"] for entry in bucket["entries"]}
    assert (best_k[b_small], best_k[b_large]) == (k_small, k_large)
    assert b_large == max(best_k)  # the table reaches the batch size the text names, no further
