"""Sections of a markdown page that one script each writes, between `<!-- NAME:begin -->` and
`<!-- NAME:end -->`, so several scripts share docs/results.md without overwriting each other's figures.

>>> page = replace_section("# Results\\n", "costs", "ratio 1.1x")
>>> page
'# Results\\n\\n<!-- costs:begin -->\\nratio 1.1x\\n<!-- costs:end -->\\n'
>>> replace_section(page, "costs", "ratio 1.0x").count("ratio")
1
>>> list(sections(page))
['costs']
"""
from __future__ import annotations

import re

_SECTION = re.compile(r"<!-- ([a-z0-9-]+):begin -->\n.*?<!-- \1:end -->\n?", re.DOTALL)


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_section(text: str, name: str, body: str, append: bool = True) -> str:
    """`text` with section `name` holding `body`; appended at the end when absent (`append`), else a
    ValueError."""
    begin, end = markers(name)
    block = f"{begin}\n{body}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text, count=1)
    if not append:
        raise ValueError(f"no {begin} ... {end} block to replace")
    return text.rstrip("\n") + "\n\n" + block + "\n"


def sections(text: str) -> dict[str, str]:
    """Every section of `text`, name -> its whole block (markers included), in order."""
    return {match.group(1): match.group(0).rstrip("\n") for match in _SECTION.finditer(text)}
