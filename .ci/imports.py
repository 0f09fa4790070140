#!/usr/bin/env python3
"""The import structure of the Rust crates: a tower, with no circles.

For each crate (the library, the demonstration, the Python module) it finds the
crate's files from the root's `mod` declarations, lists each file's
references to the crate's own modules (`use crate::...`, `super::...`, paths
such as `crate::a::b` in code, and a `mod.rs`'s paths to its children), and
builds the graph of files. A name reached through a re-export resolves to the
file that defines it; the crate root (lib.rs, main.rs) is the one file whose
`mod` declarations and re-exports are not edges.

It fails (exit 1) on a circle, naming the files in it; on an upward import:
a path through the crate root (`crate::Name`, where `Name` is not a module),
which is never followed through its re-export; and, where a crate lists its
floors (FLOORS: its top-level modules, lowest first), a file's reference to
a module of a higher floor than its own.

    python3 .ci/imports.py        # one line a file: its level and what it imports
    python3 .ci/imports.py -q     # only the verdict
"""

import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CRATES = [
    ("gpufeed (library)", "src/lib.rs"),
    ("host (binary)", "host/src/main.rs"),
    ("python module", "python/src/lib.rs"),
    ("kernel-builder", "kernel-builder/src/lib.rs"),
]

# The floors of a crate: its top-level modules, lowest first. A file may
# refer to its own floor and those below, never above; the crate root is
# above them all.
FLOORS = {
    "src/lib.rs": ["ptx", "base", "backend", "runtime", "io", "interop", "engines", "guarantees", "testing"],
}

# The backend interface and the safe API built on it: backend.rs may refer to
# none of these (they all hold backends, so a reference would close a circle
# or put the interface above what it carries).
BACKEND = ("src/lib.rs", "backend")
SAFE_LAYER = {"device", "memory", "stream", "kernel", "transfer", "pipeline", "multi", "pool"}

TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<line_comment>//[^\n]*)
  | (?P<block_comment>/\*)
  | (?P<raw_string>b?r(?P<hashes>\#*)")
  | (?P<string>b?"(?:\\.|[^"\\])*")
  | (?P<char>b?'(?:\\u\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\.|[^'\\])')
  | (?P<lifetime>'\w+)
  | (?P<ident>[A-Za-z_]\w*)
  | (?P<path_sep>::)
  | (?P<punct>.)
    """,
    re.S | re.X,
)


def tokens(text):
    """The identifiers, `::` and punctuation of Rust source, without comments,
    strings and characters."""
    out, i = [], 0
    while i < len(text):
        m = TOKEN.match(text, i)
        kind = m.lastgroup if m.lastgroup != "hashes" else "raw_string"
        if m.group("raw_string"):
            end = text.index('"' + m.group("hashes"), m.end())
            i = end + 1 + len(m.group("hashes"))
            continue
        if kind == "block_comment":
            depth, i = 1, m.end()
            while depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
            continue
        i = m.end()
        if kind in ("ident", "path_sep", "punct"):
            out.append(m.group())
    return out


def is_ident(t):
    return re.fullmatch(r"[A-Za-z_]\w*", t) is not None


def parse_use_tree(toks, i, prefix, out):
    """Parses a use tree at toks[i]; appends (path, name bound or None for a
    glob) to out; returns the index after the tree."""
    path = list(prefix)
    while True:
        t = toks[i]
        if t == "{":
            i += 1
            while toks[i] != "}":
                i = parse_use_tree(toks, i, path, out)
                if toks[i] == ",":
                    i += 1
            i += 1
            return i
        if t == "*":
            out.append((path, None))
            return i + 1
        if t == "self" and path:
            name = path[-1]
            i += 1
        else:
            path.append(t)
            name = t
            i += 1
        if i < len(toks) and toks[i] == "::":
            i += 1
            continue
        if i < len(toks) and toks[i] == "as":
            name = toks[i + 1]
            i += 2
        out.append((path, name))
        return i


class Module:
    def __init__(self, path, file):
        self.path = path  # tuple of names from the crate root
        self.file = file  # the file that holds it
        self.children = {}  # name -> module path (file or inline)
        self.imports = {}  # name bound by a `use` -> raw path (list)
        self.refs = []  # raw paths referred to, relative to this module


def scan_file(file, path, modules, pending):
    """Reads one file of the crate: its modules (the file's and inline ones),
    their `use`s and the paths in their code."""
    toks = tokens(open(os.path.join(ROOT, file), encoding="utf-8").read())
    top = Module(path, file)
    modules[path] = top
    stack = [(top, -1)]  # (module, brace depth at which it closes)
    depth = 0
    i = 0
    while i < len(toks):
        t = toks[i]
        cur = stack[-1][0]
        if t == "{":
            depth += 1
        elif t == "}":
            depth -= 1
            if depth == stack[-1][1]:
                stack.pop()
        elif t == "mod" and i + 2 < len(toks) and is_ident(toks[i + 1]) and toks[i + 2] in ";{":
            name = toks[i + 1]
            child = cur.path + (name,)
            cur.children[name] = child
            if toks[i + 2] == "{":
                modules[child] = Module(child, file)
                stack.append((modules[child], depth))
                depth += 1
                i += 3
                continue
            if cur is not top:
                raise SystemExit(f"imports: `mod {name};` inside an inline module of {file}")
            pending.append((child, file))
            i += 3
            continue
        elif t == "use" and (i == 0 or toks[i - 1] != "::"):
            if toks[i + 1] == "::":
                i += 2
            trees = []
            i = parse_use_tree(toks, i + 1, [], trees)
            for raw, name in trees:
                if name is not None:
                    cur.imports[name] = raw
                cur.refs.append(raw)
            continue
        elif (t in ("crate", "super") or t in cur.children) and (i == 0 or toks[i - 1] not in ("::", "$")):
            # (`$crate::` in a macro is the public path a macro must use.)
            if i + 1 < len(toks) and toks[i + 1] == "::":
                raw, j = [t], i + 1
                while j + 1 < len(toks) and toks[j] == "::" and is_ident(toks[j + 1]):
                    raw.append(toks[j + 1])
                    j += 2
                if len(raw) > 1:  # not `super::$name` in a macro
                    cur.refs.append(raw)
                i = j
                continue
        i += 1


def child_file(parent_file, owns_dir, name):
    d = os.path.dirname(parent_file)
    if not owns_dir:
        d = os.path.join(d, os.path.splitext(os.path.basename(parent_file))[0])
    for cand in (os.path.join(d, name + ".rs"), os.path.join(d, name, "mod.rs")):
        if os.path.exists(os.path.join(ROOT, cand)):
            return cand
    raise SystemExit(f"imports: no file for module {name} declared in {parent_file}")


def load_crate(root_file):
    modules, pending = {}, []
    scan_file(root_file, (), modules, pending)
    while pending:
        path, parent_file = pending.pop()
        owns_dir = len(path) == 1 or os.path.basename(parent_file) == "mod.rs"
        scan_file(child_file(parent_file, owns_dir, path[-1]), path, modules, pending)
    return modules


def top_module(modules, file):
    return min((m for m in modules.values() if m.file == file), key=lambda m: len(m.path))


def absolute(module, raw, modules):
    """The path from the crate root that `raw`, written in `module`, names;
    None for a path outside the crate."""
    if not raw:
        return None
    head = raw[0]
    if head == "crate":
        return tuple(raw[1:])
    if head == "self":
        return module.path + tuple(raw[1:])
    if head == "super":
        base, rest = module.path, list(raw)
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
        return base + tuple(rest)
    if head in module.children:
        return module.path + tuple(raw)
    return None


def resolve(path, modules, seen=()):
    """The file that defines what `path` (from the crate root) names, through
    the `use`s of the module it goes through."""
    k = len(path)
    while k and path[:k] not in modules:
        k -= 1
    mod = modules[path[:k]]
    if k < len(path) and path[k] in mod.imports and (path[:k + 1]) not in seen:
        target = absolute(mod, mod.imports[path[k]], modules)
        if target is not None:
            return resolve(target + path[k + 1:], modules, seen + (path[:k + 1],))
    return mod.file


def upward(root_file, modules):
    """Each reference that goes up: through the crate root (a path whose
    first name is not a module of the crate), or to a higher floor."""
    floors = FLOORS.get(root_file)
    rank = {n: i for i, n in enumerate(floors)} if floors else {}
    out = []
    for m in modules.values():
        if m.file == root_file or not m.path:
            continue
        for raw in m.refs:
            target = absolute(m, raw, modules)
            if not target:
                continue
            if (target[0],) not in modules:
                out.append((m.file, "crate::" + "::".join(target), "through the crate root"))
            elif floors and m.path[0] in rank and target[0] in rank and rank[target[0]] > rank[m.path[0]]:
                out.append((m.file, "crate::" + "::".join(target),
                            f"floor {target[0]} above {m.path[0]}"))
    return sorted(set(out))


def graph(root_file):
    """The crate's modules, its graph of files (file -> files it imports),
    and the items defined in the crate root that other files use."""
    modules = load_crate(root_file)
    edges, root_items = {}, set()
    for m in modules.values():
        edges.setdefault(m.file, set())
        if m.file == root_file:
            continue  # the crate root: `mod` declarations and re-exports
        for raw in m.refs:
            target = absolute(m, raw, modules)
            if target is None:
                continue
            f = resolve(target, modules)
            if f != m.file:
                edges[m.file].add(f)
            if f == root_file and target:
                root_items.add(target[0])
    return modules, edges, root_items


def cycles(edges):
    """The strongly connected components with more than one file (Tarjan)."""
    index, low, on, stack, out, n = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def one_cycle(comp, edges):
    """A shortest circle through the first file of a component."""
    start = comp[0]
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w in comp and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def levels(edges):
    level = {}

    def lv(v):
        if v not in level:
            level[v] = 0
            level[v] = 1 + max((lv(w) for w in edges[v]), default=-1)
        return level[v]

    for v in edges:
        lv(v)
    return level


def short(f, root_file):
    return os.path.relpath(f, os.path.dirname(root_file))


def main():
    quiet = "-q" in sys.argv[1:]
    failed = False
    for name, root_file in CRATES:
        modules, edges, root_items = graph(root_file)
        circles = cycles(edges)
        if circles:
            failed = True
            for comp in circles:
                c = one_cycle(comp, edges)
                print(f"imports: {name}: a circle of {len(comp)} files: "
                      + ", ".join(short(f, root_file) for f in comp))
                print("   for example " + " -> ".join(short(f, root_file) for f in c))
        else:
            level = levels(edges)
            if not quiet:
                print(f"{name} ({os.path.dirname(root_file)}): {len(edges)} files on "
                      f"{max(level.values()) + 1} levels; each file, its level, what it imports:")
                for f in sorted(edges, key=lambda f: (level[f], f)):
                    deps = ", ".join(short(d, root_file) for d in sorted(edges[f]))
                    print(f"   {level[f]:2} {short(f, root_file):24} {deps}")
            print(f"imports: {name}: no circles")
        ups = upward(root_file, modules)
        if ups:
            failed = True
            for f, path, why in ups:
                print(f"imports: {name}: upward: {short(f, root_file)} uses {path} ({why})")
        else:
            print(f"imports: {name}: no upward imports"
                  + (f" (floors, lowest first: {', '.join(FLOORS[root_file])})" if root_file in FLOORS else ""))
        if root_items:
            # Not a failure: the root's own helpers, used by the modules it declares.
            print(f"imports: {name}: note: items defined in {short(root_file, root_file)} itself "
                  f"(not re-exports) used by its modules: {', '.join(sorted(root_items))}")
        if root_file == BACKEND[0]:
            backend = [m for m in modules.values() if m.path[:1] == (BACKEND[1],)]
            files = {m.file for m in backend}
            bad = sorted(
                short(d, root_file)
                for f in files
                for d in edges[f]
                if top_module_name(modules, d) in SAFE_LAYER
            )
            if bad:
                failed = True
                print(f"imports: {short(min(files), root_file)} (the backend interface) refers to the "
                      f"safe layer above it: {', '.join(bad)}")
            else:
                print(f"imports: backend.rs refers to nothing of the safe layer ({', '.join(sorted(SAFE_LAYER))})")
    sys.exit(1 if failed else 0)


def top_module_name(modules, file):
    m = top_module(modules, file)
    return m.path[0] if m.path else None


if __name__ == "__main__":
    main()
