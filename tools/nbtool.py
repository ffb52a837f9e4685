"""Author notebooks as plain text: `python tools/nbtool.py py2nb src.py notebooks/NN_name.ipynb`.

The source uses the "percent" format: `# %%` starts a code cell, `# %% [markdown]` a markdown cell
(each line of it starting with `# `), `# %% tags=["parameters"]` the parameters cell. The notebook
is written without outputs, with the course kernel. `nb2py` goes back, to edit an existing chapter: it
writes each cell's id (`# %% id=0120c997`), and `py2nb` keeps it, so a round trip changes only the
cells you edited (a new cell without an id gets a fresh one).
A development tool: the course itself ships only the .ipynb files.
"""
import json
import re
import sys

import nbformat

KERNELSPEC = {"name": "llm-course", "display_name": "Python (LLM course)", "language": "python"}
_HEADER = re.compile(r"^# %%(?: \[(markdown)\])?(?: id=([\w-]+))?(?: tags=(\[.*\]))?\s*$")


def py2nb(src: str, dst: str) -> None:
    cells, kind, tags, lines, cell_id = [], None, [], [], None

    def flush():
        if kind is None:
            return
        text = "\n".join(lines).strip("\n")
        if kind == "markdown":
            text = "\n".join(ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in text.splitlines())
            cell = nbformat.v4.new_markdown_cell(text)
        else:
            cell = nbformat.v4.new_code_cell(text)
            if tags:
                cell.metadata["tags"] = tags
        if cell_id:
            cell.id = cell_id
        cells.append(cell)

    for line in open(src).read().splitlines():
        m = _HEADER.match(line)
        if m:
            flush()
            kind, cell_id, tags, lines = ("markdown" if m.group(1) else "code"), m.group(2), json.loads(m.group(3) or "[]"), []
        else:
            lines.append(line)
    flush()
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.write(nb, dst)


def nb2py(src: str, dst: str) -> None:
    nb = nbformat.read(src, as_version=4)
    out = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            out.append(f"# %% [markdown] id={cell.id}")
            out += [("# " + ln).rstrip() for ln in cell.source.splitlines()]
        else:
            tags = cell.metadata.get("tags")
            out.append(f"# %% id={cell.id}" + (f" tags={json.dumps(tags)}" if tags else ""))
            out += cell.source.splitlines()
        out.append("")
    open(dst, "w").write("\n".join(out))


if __name__ == "__main__":
    {"py2nb": py2nb, "nb2py": nb2py}[sys.argv[1]](sys.argv[2], sys.argv[3])
