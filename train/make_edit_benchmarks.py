#!/usr/bin/env python3
"""Build two small, deterministic benchmark prompt sets from HELD-OUT files only.

  out/bench/code_edit.jsonl   ~20 prompts: a held-out file (cut at a top-level statement so it
                              stays valid Python, at most --max-file-tokens tokens) plus an edit
                              instruction. The expected answer repeats the file with a small
                              change, so a drafter that copies from the prompt should do well.
                              Edit kinds (cycled): rename a local variable inside a function,
                              rename a top-level function (definition and every use), change a
                              parameter's integer/bool/str default, add a docstring. For the
                              first three `reference` is the exact edited file (computed from
                              ast positions); for the docstring kind it is one valid answer.
  out/bench/free_text.jsonl   ~20 prompts where copying does not help: "Write a Python function
                              `name(args)` that <first docstring line>." built from held-out
                              functions; `reference` is the original function, which is not
                              in the prompt.

Each line: {"id", "kind", "file", "instruction", "messages": [{"role": "user", "content"}],
            "prompt": chat-template text (starts with <bos>; encode it WITHOUT adding specials),
            "prompt_tokens", "reference", "reference_tokens"}

Usage:  python make_edit_benchmarks.py [--data DIR] [--tokenizer DIR] [--out DIR] [--n 20]
"""

import argparse
import ast
import hashlib
import json
import re
from pathlib import Path

from tokenizers import Tokenizer

HERE = Path(__file__).resolve().parent
DOC_SEP = "\x1e\n"
EDIT_KINDS = ("rename_variable", "rename_function", "change_default", "add_docstring")


def chat(content):
    return f"<bos><|turn>user\n{content}<turn|>\n<|turn>model\n"


def read_docs(path):
    text = Path(path).read_text(encoding="utf-8")
    out = []
    for doc in text.split(DOC_SEP)[:-1]:
        header, body = doc.split("\n", 1)
        out.append((header[len("# file: "):], body))
    return out


def stable_order(items, key):
    return sorted(items, key=lambda it: hashlib.sha256(key(it).encode()).hexdigest())


class Counter:
    """Token counts: plain text (special-token strings count as text) and chat prompts."""

    def __init__(self, tok):
        self.tok = tok

    def chat(self, prompt):
        return len(self.tok.encode(prompt, add_special_tokens=False).ids)

    def __call__(self, text):
        self.tok.encode_special_tokens = True
        try:
            return len(self.tok.encode(text, add_special_tokens=False).ids)
        finally:
            self.tok.encode_special_tokens = False


def truncate(src, ntok, max_tokens):
    """Longest prefix made of whole top-level statements within max_tokens (None if < 2 stmts)."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return None
    lines = src.splitlines(keepends=True)
    if ntok(src) <= max_tokens:
        return src
    best = None
    for node in tree.body:
        prefix = "".join(lines[: node.end_lineno])
        if ntok(prefix) > max_tokens:
            break
        best = prefix
    if best is None or len(ast.parse(best).body) < 2:
        return None
    return best


def replace_at(src, spans):
    """spans: (lineno, col_byte, old, new) -> src with each span replaced (utf-8 byte columns)."""
    lines = src.splitlines(keepends=True)
    for lineno, col, old, new in sorted(spans, key=lambda s: (s[0], s[1]), reverse=True):
        b = lines[lineno - 1].encode("utf-8")
        assert b[col : col + len(old.encode())] == old.encode(), (lineno, col, old)
        lines[lineno - 1] = (b[:col] + new.encode() + b[col + len(old.encode()) :]).decode("utf-8")
    return "".join(lines)


def word_count(text, name):
    return len(re.findall(rf"(?<![\w.]){re.escape(name)}(?!\w)", text)) + len(
        re.findall(rf"(?<=\.){re.escape(name)}(?!\w)", text))


def functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def segment(src, node):
    lines = src.splitlines(keepends=True)
    return "".join(lines[node.lineno - 1 : node.end_lineno])


def edit_rename_variable(src, tree):
    for fn in functions(tree):
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs}
        stores = [n for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
        for name in sorted({n.id for n in stores}):
            if len(name) < 3 or name in params or name.startswith("_"):
                continue
            uses = [n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name]
            if len(uses) < 3:
                continue
            body = segment(src, fn)
            # every textual occurrence must be one of the ast Names (no strings, attrs, kwargs)
            if word_count(body, name) != len(uses) or any(isinstance(n, ast.Global) for n in ast.walk(fn)):
                continue
            new = f"{name}_renamed" if not name.endswith("s") else f"{name[:-1]}_items"
            if word_count(src, new):
                continue
            spans = [(n.lineno, n.col_offset, name, new) for n in uses]
            instr = f"In the function `{fn.name}`, rename the local variable `{name}` to `{new}`."
            return instr, replace_at(src, spans)
    return None


def edit_rename_function(src, tree):
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name.startswith("__"):
            continue
        name = fn.name
        uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name]
        if not uses or word_count(src, name) != len(uses) + 1:
            continue
        new = f"{name}_v2"
        if word_count(src, new):
            continue
        line = src.splitlines()[fn.lineno - 1].encode("utf-8")
        col = line.index(f"def {name}(".encode()) + 4
        spans = [(fn.lineno, col, name, new)] + [(n.lineno, n.col_offset, name, new) for n in uses]
        instr = f"Rename the function `{name}` to `{new}` and update every place that uses it."
        return instr, replace_at(src, spans)
    return None


def edit_change_default(src, tree):
    for fn in functions(tree):
        args = fn.args.args + fn.args.posonlyargs
        pos = list(zip(args[len(args) - len(fn.args.defaults):], fn.args.defaults))
        kw = [(a, d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None]
        for arg, d in pos + kw:
            if not isinstance(d, ast.Constant) or d.lineno != d.end_lineno:
                continue
            v = d.value
            if isinstance(v, bool):
                new = repr(not v)
            elif isinstance(v, int):
                new = repr(v * 2 if v else 1)
            else:
                continue
            old = ast.get_source_segment(src, d)
            instr = (f"In the function `{fn.name}`, change the default value of the parameter "
                     f"`{arg.arg}` from `{old}` to `{new}`. Change nothing else.")
            return instr, replace_at(src, [(d.lineno, d.col_offset, old, new)])
    return None


def edit_add_docstring(src, tree):
    for fn in functions(tree):
        if ast.get_docstring(fn) is not None or fn.name.startswith("_") or len(fn.body) < 2:
            continue
        first = fn.body[0]
        line = src.splitlines(keepends=True)[first.lineno - 1]
        indent = line[: len(line) - len(line.lstrip())]
        if not indent.strip() == "" or first.lineno == fn.lineno:
            continue
        words = fn.name.replace("_", " ").strip()
        doc = f'{indent}"""{words[:1].upper() + words[1:]}."""\n'
        lines = src.splitlines(keepends=True)
        edited = "".join(lines[: first.lineno - 1]) + doc + "".join(lines[first.lineno - 1 :])
        instr = f"Add a one-line docstring to the function `{fn.name}`."
        return instr, edited
    return None


EDITORS = {
    "rename_variable": edit_rename_variable,
    "rename_function": edit_rename_function,
    "change_default": edit_change_default,
    "add_docstring": edit_add_docstring,
}


def build_code_edit(docs, ntok, n, max_tokens):
    rows = []
    k = 0
    for path, body in stable_order(docs, key=lambda d: d[0]):
        if len(rows) >= n:
            break
        src = truncate(body, ntok, max_tokens)
        if src is None or ntok(src) < 150:
            continue
        tree = ast.parse(src)
        # try the kinds starting at the next one in the cycle, so kinds stay balanced
        for j in range(len(EDIT_KINDS)):
            kind = EDIT_KINDS[(k + j) % len(EDIT_KINDS)]
            res = EDITORS[kind](src, tree)
            if res is None:
                continue
            instr, edited = res
            assert edited != src
            ast.parse(edited)
            content = (f"{instr}\n\nFile `{path}`:\n```python\n{src}```\n"
                       "Reply with the complete edited file in one ```python block.")
            prompt = chat(content)
            reference = f"```python\n{edited}```"
            rows.append({
                "id": f"edit-{len(rows):02d}", "kind": kind, "file": path, "instruction": instr,
                "messages": [{"role": "user", "content": content}], "prompt": prompt,
                "prompt_tokens": ntok.chat(prompt), "reference": reference,
                "reference_tokens": ntok(reference), "reference_exact": kind != "add_docstring",
            })
            k += 1
            break
    return rows


def signature(fn, src):
    line = src.splitlines()[fn.lineno - 1].strip()
    m = re.match(r"(async\s+)?def\s+(.*?\))\s*(->.*)?:\s*$", line)
    return m.group(2) if m else None


def build_free_text(docs, ntok, n):
    rows, seen = [], set()
    for path, body in stable_order(docs, key=lambda d: "free:" + d[0]):
        try:
            tree = ast.parse(body)
        except SyntaxError:
            continue
        for fn in functions(tree):
            doc = ast.get_docstring(fn)
            if not doc or fn.name.startswith("_") or fn.name in seen or fn.name.startswith("test"):
                continue
            summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
            summary = re.sub(r"\s+", " ", summary)
            nlines = fn.end_lineno - fn.lineno + 1
            sig = signature(fn, body)
            if sig is None or not (25 <= len(summary) <= 300) or not (5 <= nlines <= 40):
                continue
            if summary[1:2].islower():
                summary = summary[:1].lower() + summary[1:]
            if summary.endswith("."):
                summary = summary[:-1]
            what = "method" if re.match(r"\w+\((self|cls)\b", sig) else "function"
            content = (f"Write a Python {what} `{sig}` that does the following: {summary}.\n"
                       "Reply with the code in one ```python block.")
            prompt = chat(content)
            reference = f"```python\n{segment(body, fn)}```"
            rows.append({
                "id": f"free-{len(rows):02d}", "kind": "write_function", "file": path,
                "instruction": content.split("\n")[0], "messages": [{"role": "user", "content": content}],
                "prompt": prompt, "prompt_tokens": ntok.chat(prompt), "reference": reference,
                "reference_tokens": ntok(reference), "reference_exact": False,
            })
            seen.add(fn.name)
            break  # at most one function per file
        if len(rows) >= n:
            break
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(HERE / "data"))
    ap.add_argument("--tokenizer", default=None, help="folder with tokenizer.json (default DATA/tokenizer)")
    ap.add_argument("--out", default=str(HERE / "out" / "bench"))
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--max-file-tokens", type=int, default=1500)
    args = ap.parse_args()
    data = Path(args.data)
    tok = Tokenizer.from_file(str(Path(args.tokenizer or data / "tokenizer") / "tokenizer.json"))
    ntok = Counter(tok)
    docs = read_docs(data / "heldout.txt")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    edit = build_code_edit(docs, ntok, args.n, args.max_file_tokens)
    free = build_free_text(docs, ntok, args.n)
    for name, rows in (("code_edit.jsonl", edit), ("free_text.jsonl", free)):
        with open(out / name, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        kinds = {}
        for r in rows:
            kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
        pt = [r["prompt_tokens"] for r in rows]
        rt = [r["reference_tokens"] for r in rows]
        print(f"wrote {out / name}: {len(rows)} prompts {kinds}; prompt tokens "
              f"{min(pt)}..{max(pt)} (mean {sum(pt) / len(pt):.0f}), reference tokens mean {sum(rt) / len(rt):.0f}")


if __name__ == "__main__":
    main()
