"""MkDocs hook: the API reference covers every public name, and every public name is documented.

[Note: why a hook]
mkdocstrings renders what a page asks for and stays silent about the rest: a new public function
that no page names, or one without a docstring (`show_if_no_docstring: false` just leaves it
out), builds cleanly. This hook makes both a warning, so `mkdocs build --strict` fails on them:

* PUBLIC lists the public surface: each module's `__all__` (minus submodules and constants)
  plus the integration classes. Each name must be rendered by a `::: path` directive in
  docs/api/, directly or through its parent (a class renders its public methods).
* Each public function, class and public method (defined in zerokern, not inherited from
  torch / transformers / accelerate) must have a docstring, and a function or method with
  parameters must name each of them in a Google-style `Args:` section (griffe parses it as
  mkdocstrings does; `self`, `cls` and `*args`/`**kwargs` forwarded verbatim are exempt when
  the docstring says where they go).

Broken links, anchors and nav entries are MkDocs' own `validation:` warnings (mkdocs.yml), and
griffe's docstring warnings (an `Args:` entry that is not a parameter) reach MkDocs' logger
through mkdocstrings: under --strict each of those fails the build as well.
"""

from __future__ import annotations

import inspect
import logging
import re
from pathlib import Path

import griffe

log = logging.getLogger("mkdocs.hooks.check_api")

# Modules whose __all__ is public API, and names that are public without an __all__ entry.
MODULES = ["zerokern", "zerokern.kernels", "zerokern.checkpoint", "zerokern.checkpointing",
           "zerokern.engine", "zerokern.pipelining"]
EXTRA = ["zerokern.integrations.transformers.ZeroTrainer",
         "zerokern.integrations.accelerate.ZeroAccelerator"]
SKIP = {"__version__", "VERSION"}            # constants, documented in prose
EXEMPT_PARAMS = {"self", "cls"}


def _public_names(root: griffe.Module) -> list:
    names = []
    for mod_path in MODULES:
        mod = root if mod_path == "zerokern" else root[mod_path[len("zerokern."):]]
        exported = mod.exports or []
        for name in exported:
            name = str(name)
            if name in SKIP:
                continue
            obj = mod[name]
            if obj.is_alias:
                try:
                    obj = obj.final_target
                except griffe.AliasResolutionError:
                    pass
            if obj.is_module:
                continue
            names.append((f"{mod_path}.{name}", obj))
    for path in EXTRA:
        names.append((path, root[path[len("zerokern."):]]))
    return names


def _rendered_paths(docs_dir: Path) -> set:
    paths = set()
    for md in (docs_dir / "api").glob("*.md"):
        paths.update(re.findall(r"^::: *([\w.]+)", md.read_text(), flags=re.M))
    return paths


def _param_names(fn: griffe.Function) -> list:
    return [p.name for p in fn.parameters if p.name not in EXEMPT_PARAMS]


def _documented_params(obj) -> set:
    if obj.docstring is None:
        return set()
    found = set()
    for section in obj.docstring.parse("google", warn_missing_types=False,
                                       warn_unknown_params=False):
        # a dataclass documents its __init__ parameters as Attributes
        if section.kind in (griffe.DocstringSectionKind.parameters,
                            griffe.DocstringSectionKind.attributes):
            found.update(p.name.lstrip("*") for p in section.value)
    return found


def _check_function(path: str, fn, problems: list, doc_owner=None) -> None:
    owner = doc_owner or fn
    if fn.docstring is None and owner.docstring is None:
        problems.append(f"{path}: no docstring")
        return
    documented = _documented_params(fn) | (_documented_params(doc_owner) if doc_owner else set())
    missing = [n for n in _param_names(fn) if n not in documented]
    # *args / **kwargs passed through verbatim may be described in prose instead.
    text = (fn.docstring.value if fn.docstring else "") + (
        owner.docstring.value if owner is not fn and owner.docstring else "")
    missing = [n for n in missing
               if not (n in ("args", "kwargs") and re.search(r"\*\*?(args|kwargs)", text))]
    if missing:
        problems.append(f"{path}: parameter(s) {', '.join(missing)} not in the docstring's "
                        "Args section")


def _runtime_docstring(obj) -> None:
    """A class whose docstring is assembled at import (`__doc__ = "..." + ENGINE_ARGS`, the
    optimizer rules share their argument list so) has none for static analysis: take the
    imported object's `__doc__`, as mkdocstrings does with `force_inspection` on its page."""
    if obj.docstring is not None or not obj.is_class:
        return
    import importlib

    try:
        value = getattr(importlib.import_module(obj.module.path), obj.name)
    except Exception:  # noqa: BLE001 - reported as "no docstring" below
        return
    if getattr(value, "__doc__", None):
        obj.docstring = griffe.Docstring(inspect.cleandoc(value.__doc__), parent=obj)


def _check(path: str, obj, problems: list) -> None:
    _runtime_docstring(obj)
    if obj.is_function:
        _check_function(path, obj, problems)
    elif obj.is_class:
        if obj.docstring is None:
            problems.append(f"{path}: no docstring")
        init = obj.members.get("__init__")
        if init is not None and init.is_function:
            _check_function(f"{path}.__init__", init, problems, doc_owner=obj)
        members = list(obj.members.items())
        try:   # methods from zerokern mixins (e.g. the engine's checkpoint methods)
            members += [(n, m.final_target) for n, m in obj.inherited_members.items()
                        if m.final_target.path.startswith("zerokern.")]
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            pass
        for name, member in members:
            if name.startswith("_") or member.is_alias:
                continue
            if member.is_function:
                if "property" in member.labels:
                    if member.docstring is None:
                        problems.append(f"{path}.{name}: no docstring (property)")
                    continue
                _check_function(f"{path}.{name}", member, problems)
    elif obj.docstring is None and not obj.is_attribute:
        problems.append(f"{path}: no docstring")


def on_pre_build(config, **kwargs) -> None:
    root_dir = Path(config["config_file_path"]).parent
    # imports (here and mkdocstrings' force_inspection) must see this checkout's zerokern, not
    # an installed one
    import sys

    if str(root_dir) not in sys.path[:1]:
        sys.path.insert(0, str(root_dir))
    for name in [m for m in sys.modules if m == "zerokern" or m.startswith("zerokern.")]:
        del sys.modules[name]
    docs_dir = Path(config["docs_dir"])
    loader = griffe.GriffeLoader(search_paths=[str(root_dir)],
                                 docstring_parser=griffe.Parser.google)
    root = loader.load("zerokern")
    loader.resolve_aliases(implicit=False, external=False)
    rendered = set()
    for r in _rendered_paths(docs_dir):   # a directive may name an alias (zerokern.initialize)
        rendered.add(r)
        try:
            target = root[r[len("zerokern."):]] if r != "zerokern" else root
            rendered.add(target.final_target.path if target.is_alias else target.path)
        except (KeyError, griffe.AliasResolutionError):
            problems_early = f"docs/api: `::: {r}` names nothing in zerokern"
            log.warning("API docs: %s", problems_early)
    problems: list = []
    for path, obj in _public_names(root):
        canonical = obj.path
        covered = any(path == r or canonical == r or path.startswith(r + ".")
                      or canonical.startswith(r + ".") for r in rendered)
        if not covered:
            problems.append(f"{path}: public, but no `::: {path}` in docs/api/")
        _check(path, obj, problems)
    for p in problems:
        log.warning("API docs: %s", p)
