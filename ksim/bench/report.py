"""Render a results document as Markdown (the generated part of benchmarks/README.md).

    python -m ksim.bench.report benchmarks/results/results.json [README.md]
    python -m ksim.bench.report --plots benchmarks/results/results.json DIR/PREFIX.png

With a README path, the text between the ``<!-- results:begin -->`` and
``<!-- results:end -->`` markers is replaced; otherwise the Markdown is printed.
``--plots`` draws every benchmark's plot again from the JSON (PREFIX-NAME.png).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ksim.bench.common import Table, markdown_table

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def render(doc: dict[str, Any], plot_dir: str = "results") -> str:
    m = doc["machine"]
    out = [f"Run of {doc['started']} (mode: {doc['mode']}), from `{doc.get('json_name', 'results.json')}`.",
           "",
           f"Machine: {m.get('cpu')}, {m.get('cores')} cores"
           f"{' (virtual machine)' if m.get('hypervisor') else ''}, Linux {m.get('kernel')}, "
           f"Python {m.get('python')}, {m.get('gcc')}, {m.get('qemu')}, unicorn {m.get('unicorn')}, "
           f"capstone {m.get('capstone')}; shared with other work while it ran.", ""]
    if doc.get("note"):  # how the document was put together, when not by one `bench all`
        out[1:1] = ["", str(doc["note"])]
    for name, entry in doc["benchmarks"].items():
        out.append(f"### {name}: {entry.get('title', '')}")
        out.append("")
        if entry["status"] != "ok":
            out.append(f"*{entry['status']}*: {entry['reason']}")
            out.append("")
            continue
        out.append(f"{entry['seconds']:.0f} s.")
        out.append("")
        if entry.get("plot"):
            out.append(f"![{name}]({plot_dir}/{entry['plot']})")
            out.append("")
        for t in entry["tables"]:
            out.append(f"**{t['title']}**")
            out.append("")
            out.append(markdown_table(Table(t["title"], t["columns"], t["rows"])))
            out.append("")
        for note in entry["notes"]:
            out.append(f"- {note}")
        out.append("")
    return "\n".join(out)


def replot(json_path: str, plot_path: str) -> None:
    from ksim.bench import runner

    with open(json_path) as f:
        doc = json.load(f)
    for name, entry in doc["benchmarks"].items():
        if entry["status"] == "ok":
            path = runner.plot_file(plot_path, name, many=True)
            runner.module(name).plot(entry, path)
            entry["plot"] = path.rsplit("/", 1)[-1]
    runner.write_json(doc, json_path)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--plots":
        replot(argv[1], argv[2])
        return 0
    with open(argv[0]) as f:
        doc = json.load(f)
    doc["json_name"] = argv[0].rsplit("/", 1)[-1]
    text = render(doc)
    if len(argv) < 2:
        print(text)
        return 0
    with open(argv[1]) as f:
        readme = f.read()
    head, rest = readme.split(BEGIN, 1)
    _old, tail = rest.split(END, 1)
    with open(argv[1], "w") as f:
        f.write(head + BEGIN + "\n" + text + "\n" + END + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
