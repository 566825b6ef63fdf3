"""Griffe extension: render the package's reST docstring markup as Markdown for mkdocstrings.

The docstrings of adaclip are Google style (``Args:``, ``Returns:``) with reST inline and block
markup, which mkdocstrings (Markdown) would otherwise print literally. Before rendering, this
rewrites each docstring's text (the source is untouched):

- cross-reference roles ``:class:`~a.b.C``` → ```C``` (``~`` keeps the last component, as
  Sphinx does), other roles ``:func:`x``` → ```x```;
- ``.. math::`` blocks → display math (``$$ … $$``, rendered by MathJax through arithmatex);
- ``.. code-block:: lang`` and ``text::`` literal blocks → fenced code blocks;
- reST "simple tables" (``====  ====`` borders) → Markdown tables;
- reST section titles (a line underlined with ``---``/``===``) → bold lines, so that they do not
  become headings inside the API page;
- external links ```text <url>`_`` → ``[text](url)``;
- the reST escaped space ``\\ `` → nothing.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")
_TABLE_BORDER = re.compile(r"^\s*=+(?:\s+=+)+\s*$")
_UNDERLINE = re.compile(r"^\s*(-{3,}|={3,})\s*$")
_LINK = re.compile(r"`([^`<]+?)\s*<([^>]+)>`_")
_DIRECTIVE = re.compile(r"^(\s*)\.\. (math|code-block|code)::\s*(.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _block(lines: list[str], start: int, base: int) -> tuple[list[str], int]:
    """The indented block after line ``start - 1`` (deeper than ``base``), dedented; and the
    index of the first line after it."""
    i, body = start, []
    while i < len(lines):
        line = lines[i]
        if line.strip() == "":
            body.append("")
            i += 1
            continue
        if _indent(line) <= base:
            break
        body.append(line)
        i += 1
    while body and body[-1] == "":
        body.pop()
        i -= 1
    while body and body[0] == "":
        body.pop(0)
    depth = min((_indent(x) for x in body if x.strip()), default=0)
    return [x[depth:] if x.strip() else "" for x in body], i


def _table(lines: list[str], start: int) -> tuple[list[str], int] | None:
    border = lines[start]
    spans = [(m.start(), m.end()) for m in re.finditer(r"=+", border)]
    rows, i, borders = [], start + 1, 1
    while i < len(lines) and borders < 3:
        line = lines[i]
        if _TABLE_BORDER.match(line):
            borders += 1
            if borders == 2:
                rows.append(None)  # header separator
        elif line.strip():
            cells = []
            for k, (a, _) in enumerate(spans):
                b = spans[k + 1][0] if k + 1 < len(spans) else len(line)
                cells.append(line[a:b].strip())
            rows.append(cells)
        i += 1
    if borders < 3 or None not in rows:
        return None
    indent = " " * _indent(border)
    out = []
    for row in rows:
        if row is None:
            out.append(indent + "|" + "|".join("---" for _ in spans) + "|")
        else:
            out.append(indent + "| " + " | ".join(row) + " |")
    return out, i


def rest_to_markdown(text: str) -> str:
    text = _ROLE.sub(lambda m: "`" + (m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)) + "`", text)
    text = text.replace("\\ ", "")
    text = _LINK.sub(r"[\1](\2)", text)
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = _DIRECTIVE.match(line)
        if directive:
            pad, kind, arg = directive.groups()
            body, i = _block(lines, i + 1, len(pad))
            # Python-Markdown nests blocks in list items only at 4 spaces: a block indented
            # less (a bullet's continuation) is lifted to the margin.
            pad = pad if len(pad) >= 4 else ""
            if kind == "math":
                content = ([arg.strip()] if arg.strip() else []) + body
                out += ["", pad + "$$", *(pad + x for x in content), pad + "$$", ""]
            else:
                out += ["", pad + "```" + (arg or "python"), *(pad + x for x in body), pad + "```", ""]
            continue
        if _TABLE_BORDER.match(line):
            table = _table(lines, i)
            if table is not None:
                rows, i = table
                if out and out[-1].strip():
                    out.append("")
                out += rows
                continue
        if (
            i + 1 < len(lines)
            and line.strip()
            and _UNDERLINE.match(lines[i + 1])
            and len(lines[i + 1].strip()) >= len(line.strip()) - 1
            and (not out or not out[-1].strip())
        ):
            out += [line[: _indent(line)] + "**" + line.strip() + "**", ""]
            i += 2
            continue
        if line.rstrip().endswith("::") and i + 1 < len(lines):
            pad = _indent(line)
            body, j = _block(lines, i + 1, pad)
            if body:
                head = line.rstrip()[:-2].rstrip()
                if head.strip():
                    out.append(head + ":")
                fence = " " * pad if pad >= 4 else ""
                out += ["", fence + "```python", *(fence + x for x in body), fence + "```", ""]
                i = j
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


class ReSTToMarkdown(griffe.Extension):
    """Rewrite every docstring's reST markup as Markdown before mkdocstrings renders it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rest_to_markdown(obj.docstring.value)
