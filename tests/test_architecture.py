"""The shape of course_lib, drawn from its imports: folders that import one way (the workbook on top, then the
recipes, the SFT product, the parallelisms, the memory model, and the base modules at course_lib's top level
below them all), no import cycle, rank-side code never reaching notebook-side code (`cl.<name>` counts as an
import of the module it names), recipes that import without side effects and share one flag vocabulary."""
import ast
import functools
import inspect
import subprocess
import sys
import textwrap

import pytest

import course_lib
from course_lib.paths import REPO_ROOT

LIB = REPO_ROOT / "course_lib"
# The folders, lowest first: a module imports its own folder's modules and those of the folders below, never above.
# "base": the modules at course_lib's top level (env, paths, presets, config, models, timing).
LAYERS = ("base", "memory", "parallel", "sft", "recipes", "workbook")
# What runs in a notebook's kernel only; everything else runs inside ranks too.
NOTEBOOK_SIDE = {"workbook"}
RECIPES = sorted(p.stem for p in (LIB / "recipes").glob("*.py") if p.stem != "__init__")


@functools.cache
def module_files() -> dict:
    """Every module of the library by its dotted name under course_lib (a folder's __init__.py by the folder's
    name: `memory` is the memory model), without the facade course_lib/__init__.py and the reference solutions
    (text the exercises read, never imported)."""
    files = {}
    for path in sorted(LIB.rglob("*.py")):
        parts = path.relative_to(LIB).with_suffix("").parts
        if "solutions" in parts or parts == ("__init__",):
            continue
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def folder(name: str) -> str:
    """The folder a module sits in: `parallel.zero` -> parallel, `memory` (memory/__init__.py) -> memory, a module
    at course_lib's top level -> base."""
    first = name.split(".")[0]
    return first if (LIB / first).is_dir() else "base"


@functools.cache
def facade_module(attr: str) -> str | None:
    """The module that `cl.<attr>` (or `from course_lib import <attr>`) reaches through the facade:
    `cl.zero` -> parallel.zero, `cl.Ledger` -> workbook.results, `cl.launch` -> workbook.launch."""
    if not hasattr(course_lib, attr):
        return None
    value = getattr(course_lib, attr)
    name = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", "")
    return name.removeprefix("course_lib.") if name.startswith("course_lib.") else None


def imports_of(path, name: str) -> dict[str, list[int]]:
    """The course_lib modules `path` (the module `name`) imports, with the lines: at module level or inside
    functions (a deferred import is an import too), and every `cl.<attr>` where `cl` is `import course_lib as cl`."""
    tree = ast.parse(path.read_text())
    package = ["course_lib", *name.split(".")[:-1]] if path.name != "__init__.py" else ["course_lib", *name.split(".")]
    found, facades = {}, set()

    def add(target, node):
        if target and target != name:
            found.setdefault(target, []).append(node.lineno)

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            parts = base + (node.module.split(".") if node.module else [])
            if parts[:1] != ["course_lib"]:
                continue
            if len(parts) > 1:
                add(".".join(parts[1:]) if ".".join(parts[1:]) in module_files() else None, node)
            for alias in node.names:
                dotted = ".".join(parts[1:] + [alias.name])
                if dotted in module_files():
                    add(dotted, node)
                elif len(parts) == 1:  # `from course_lib import Ledger`: a name of the facade
                    add(facade_module(alias.name), node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "course_lib":
                    facades.add(alias.asname or alias.name)
                elif alias.name.startswith("course_lib."):
                    add(alias.name.removeprefix("course_lib."), node)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in facades:
            add(facade_module(node.attr), node)
    return found


@pytest.fixture(scope="module")
def graph():
    return {name: imports_of(path, name) for name, path in module_files().items()}


def test_every_module_sits_in_a_folder_of_the_layers():
    unknown = sorted(name for name in module_files() if folder(name) not in LAYERS)
    assert not unknown, f"{unknown}: a folder the layers do not know; add it to LAYERS, in its place"


def test_folders_import_one_way(graph):
    """workbook -> recipes -> sft -> parallel -> memory -> base, never back."""
    back = [f"{name}:{lines[0]} imports {target} ({folder(name)} -> {folder(target)})"
            for name, targets in sorted(graph.items()) for target, lines in sorted(targets.items())
            if LAYERS.index(folder(target)) > LAYERS.index(folder(name))]
    assert not back, "imports against the layers:\n" + "\n".join(back)


def test_the_import_graph_has_no_cycle(graph):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_rank_side_code_never_reaches_notebook_side_code(graph):
    for start in sorted(name for name in graph if folder(name) not in NOTEBOOK_SIDE):
        seen, todo = set(), [start]
        while todo:
            for nxt in set(graph[todo.pop()]) - seen:
                seen.add(nxt)
                todo.append(nxt)
        reached = sorted(n for n in seen if folder(n) in NOTEBOOK_SIDE)
        assert not reached, f"{start} (rank-side) reaches {reached} (notebook-side)"


def test_the_checker_sees_every_kind_of_import(tmp_path):
    """The checks above can fail: what a rank-side module reaches of the workbook through `cl.<name>`, a name of
    the facade, a relative import or a deferred absolute one is seen, each."""
    fake = tmp_path / "fake.py"
    fake.write_text(textwrap.dedent("""\
        import course_lib as cl
        from course_lib import Ledger
        from ..workbook import report

        def f():
            from course_lib.workbook.runner import main
            return cl.launch, cl.exercises, cl.zero, cl.env
        """))
    found = imports_of(fake, "sft.fake")
    assert set(found) == {"workbook", "workbook.results", "workbook.report", "workbook.runner", "workbook.launch",
                          "workbook.exercises", "parallel.zero", "env"}, found  # (`workbook`: its __init__.py)


def test_recipes_import_without_side_effects_and_have_a_main_and_a_config():
    """... and a rank that imports them all (with course_lib) loads nothing of the workbook."""
    code = ("import sys, importlib; sys.argv = ['x', '--no-such-flag']\n"
            "import torch.distributed as dist\n"
            f"for name in {RECIPES!r}:\n"
            "    m = importlib.import_module('course_lib.recipes.' + name)\n"
            "    assert callable(m.main) and hasattr(m, 'Config'), name\n"
            "assert not dist.is_initialized()\n"
            "workbook = sorted(m for m in sys.modules if m.startswith('course_lib.workbook'))\n"
            "assert not workbook, workbook\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "", f"importing a recipe printed: {done.stdout[:500]}"


def flags(recipe: str) -> set[str]:
    import importlib

    config = importlib.import_module(f"course_lib.recipes.{recipe}").Config
    return {o for a in config.parser()._actions for o in a.option_strings if o.startswith("--")}


def test_every_recipe_speaks_one_flag_vocabulary():
    from dataclasses import fields

    from course_lib.config import ModelSize

    size = {"--" + f.name.replace("_", "-") for f in fields(ModelSize)}
    retired = {"--batch", "--batch-size", "--micro-batch-size", "--accum-steps", "--accum-k", "--seq", "--model",
               "--hidden", "--layers", "--repeats"}
    for recipe in RECIPES:
        have = flags(recipe)
        assert not have & retired, f"{recipe}.py still has {sorted(have & retired)}"
        # these load a checkpoint directory (--model-path); build_check runs learners' cells at sizes of its own
        if recipe not in ("sft", "capstone", "sft_trainer", "build_check"):
            assert size <= have, f"{recipe}.py lacks the model-size flags {sorted(size - have)}"
    shared = {"--micro-batch", "--seq-len", "--seed", "--steps"}
    for recipe in ("ddp", "fsdp", "zero", "sft", "capstone", "sft_trainer"):
        assert shared <= flags(recipe), recipe
    assert "--accum" in flags("ddp") & flags("zero") & flags("sft")


def test_a_config_round_trips_through_its_command_line():
    from course_lib.recipes import sft, zero

    cfg = sft.Config(model_path="m", data_dir="d", out_dir="o", fsdp=True, warmup=None, export=False)
    assert sft.Config.parse(cfg.to_argv()) == cfg
    z = zero.Config(persistence_threshold=None, configs="zero3:fp32")
    assert zero.Config.parse(z.to_argv()) == z


def test_a_recipe_run_by_hand_gets_real_sizes_and_a_notebook_names_its_own():
    """`torchrun ddp.py` with no flags trains Qwen2.5-0.5B's shape (the gpu profile's), not the tiny model; every
    chapter recipe's defaults make a model whose heads split its width; a config a notebook builds from the cpu
    profile launches with its sizes on the command line."""
    import importlib

    import course_lib as cl
    from course_lib.recipes import ddp

    assert ddp.Config.parse([]).size() == cl.models.QWEN25["Qwen2.5-0.5B"]
    for name in ("ddp", "ddp_comm", "fsdp", "pp", "tp", "zero"):
        cfg = importlib.import_module(f"course_lib.recipes.{name}").Config.parse([])
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        assert cfg.hidden_size % heads == 0 and heads % kv == 0, (name, cfg.size())
    small = ddp.Config.from_preset(cl.preset("cpu", chapter="05"))
    argv = small.to_argv()
    assert argv[argv.index("--hidden-size") + 1] == str(cl.models.TINY["hidden_size"])
    assert ddp.Config.parse(argv) == small


def test_importing_the_library_stays_light():
    code = ("import sys, course_lib as cl\n"
            "heavy = [m for m in ('tensorflow', 'IPython', 'ipywidgets', 'deepspeed', 'datasets', 'peft') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "assert cl.checkpoint.is_complete and cl.zero.prepare and cl.data.pack and cl.backends.pick\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
