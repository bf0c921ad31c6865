"""Writes submission.py, the one file the leaderboard takes, from the package modules ``custom_kernel`` needs.

The entry is ``nvfp4_gemv/leaderboard.py``; the modules it imports from the package (``from .x import ...``),
and theirs, are stitched into one file in dependency order, each under a banner with its own docstring, with
the package-relative imports dropped and the competition's ``task`` types imported in place of the line that
stands in for them. The stitched file is one namespace, so the tool refuses what would change meaning there:
a package import that is not ``from .module import name`` at a module's top level, a name imported that its
module does not define, and a top-level name that two of the modules define. The modules import only torch,
cutlass, cuda (the bindings), apache-tvm-ffi (where installed, inside a function) and the standard library.

``--check`` exits 1 where the file on disk differs (CI runs it through tests/tools/test_packaging.py).

Usage: python tools/gen_submission.py [--check]
"""

import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "nvfp4_gemv")
ENTRY = "leaderboard"
TARGET = os.path.join(ROOT, "submission.py")
TYPES_LINE = ("input_t = output_t = tuple  # submission.py: the competition's own types, from task "
              "(tools/gen_submission.py)\n")


def _parse(name):
    path = os.path.join(PACKAGE, name + ".py")
    with open(path) as f:
        text = f.read()
    return path, text, ast.parse(text, path)


def _package_imports(name, tree, path):
    """``[(module, [names], node)]`` of a module's package-relative imports; refuses any other form."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node not in tree.body:
                raise SystemExit(f"{path}:{node.lineno}: a package import inside a block: the stitched file "
                                 "has no package to import from")
            if node.level != 1 or not node.module or any(a.asname or a.name == "*" for a in node.names):
                raise SystemExit(f"{path}:{node.lineno}: only 'from .module import name, ...' can be stitched")
            found.append((node.module, [a.name for a in node.names], node))
    return found


def _bindings(tree):
    """Top-level names a module defines (``defs``) and those its absolute imports bind (``imports``:
    name -> what is imported), the bodies of top-level ``try`` included."""
    defs, imports = set(), {}
    body = list(tree.body)
    for node in tree.body:
        if isinstance(node, ast.Try):
            body += node.body + [n for h in node.handlers for n in h.body]
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        defs.add(n.id)
        elif isinstance(node, ast.Import):
            for a in node.names:
                imports[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            for a in node.names:
                imports[a.asname or a.name] = f"{node.module}.{a.name}"
    return defs, imports


def modules():
    """The package modules the entry needs, each after those it imports: ``[(name, path, text, tree)]``."""
    order, seen = [], {}

    def visit(name, chain):
        if name in chain:
            raise SystemExit(f"nvfp4_gemv: an import cycle: {' -> '.join(chain + (name,))}")
        if name in seen:
            return
        path, text, tree = _parse(name)
        seen[name] = (path, text, tree)
        for dep, _, _ in _package_imports(name, tree, path):
            visit(dep, chain + (name,))
        order.append(name)

    visit(ENTRY, ())
    return [(name, *seen[name]) for name in order]


def sources():
    """The files submission.py is made of, relative to the repository root."""
    return [os.path.relpath(path, ROOT) for _, path, _, _ in modules()]


def render():
    mods = modules()
    defined, bound = {}, {}  # name -> module defining it; name -> (what it imports, module)
    top = {}  # module -> the names it binds at its top
    for name, path, text, tree in mods:
        defs, imports = _bindings(tree)
        top[name] = defs | set(imports)
        for n in defs:
            other = defined.get(n) or (bound[n][1] if n in bound else None)
            if other:
                raise SystemExit(f"{path}: '{n}' is also defined in nvfp4_gemv/{other}.py: one name in the "
                                 "stitched file")
            defined[n] = name
        for n, what in imports.items():
            if n in defined or (n in bound and bound[n][1] != name and bound[n][0] != what):
                raise SystemExit(f"{path}: '{n}' is bound otherwise in another module: one name in the stitched file")
            bound[n] = (what, name)
    for name, path, text, tree in mods:
        for dep, names, node in _package_imports(name, tree, path):
            missing = [n for n in names if n not in top[dep]]
            if missing:
                raise SystemExit(f"{path}:{node.lineno}: {missing} not defined at the top of nvfp4_gemv/{dep}.py")

    listed = ", ".join(name for name, *_ in mods)
    out = [f"# Generated by tools/gen_submission.py from the nvfp4_gemv modules {listed}\n"
           "# (each below under its banner): edit those files, then run the tool.\n"]
    for name, path, text, tree in mods:
        lines = text.splitlines(keepends=True)
        drop = set()
        for _, _, node in _package_imports(name, tree, path):
            drop.update(range(node.lineno - 1, node.end_lineno))
        body = "".join(line for i, line in enumerate(lines) if i not in drop)
        body = re.sub(r"\n{4,}", "\n\n\n", body)  # no wider gaps where the package imports stood
        if name == ENTRY:
            if body.count(TYPES_LINE) != 1:
                raise SystemExit(f"{path}: expected the types line once:\n{TYPES_LINE}")
            body = body.replace(TYPES_LINE, "from task import input_t, output_t\n")
            doc = ast.get_docstring(tree, clean=False)
            head = f'"""{doc}"""\n'
            if not body.startswith(head):
                raise SystemExit(f"{path}: expected the module docstring first")
            # the entry's docstring describes the whole file: it opens it
            out.insert(1, head)
            body = body[len(head):]
        out.append(f"\n\n# {'=' * 100}\n# nvfp4_gemv/{name}.py\n# {'=' * 100}\n\n{body.strip()}\n")
    return "".join(out)


def main(argv):
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 where submission.py on disk differs; write nothing")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        with open(TARGET) as f:
            if f.read() != text:
                print("submission.py is out of date: run python tools/gen_submission.py", file=sys.stderr)
                return 1
        return 0
    with open(TARGET, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
