"""The shape of course_lib, drawn from its imports: no cycle, rank-side code never reaching notebook-side code,
short modules, recipes that import without side effects and share one flag vocabulary."""
import ast
import subprocess
import sys

import pytest

from course_lib.results import REPO_ROOT

LIB = REPO_ROOT / "course_lib"
# What runs in a notebook kernel only (launching, executing notebooks, reports, Lab, widgets) ...
NOTEBOOK_SIDE = {"launch", "launch_errors", "background", "runner", "kernels", "report", "lab", "widgets", "book", "bench", "builds",
                "exercises"}
# ... and the library modules a rank imports (every recipe is rank-side too).
RANK_SIDE = {"backends", "capstone", "checkpoint", "config", "data", "dist", "env", "evaluation", "handshake", "measure",
             "memory", "model_dir", "models", "optional", "paths", "presets", "results", "timing", "tokenizer", "train", "zero",
             "fsdp2", "live_memory", "losses", "speed", "data_parallel", "tensor_parallel", "pipeline_parallel", "precision", "comm"}
RECIPES = sorted(p.stem for p in (LIB / "recipes").glob("*.py") if p.stem != "__init__")
def module_files() -> dict:
    files = {p.stem: p for p in LIB.glob("*.py") if p.stem != "__init__"}
    files.update({f"recipes.{name}": LIB / "recipes" / f"{name}.py" for name in RECIPES})
    return files


def imports_of(path, name: str) -> set[str]:
    """The course_lib modules `path` imports, at module level or inside functions (a deferred import is an
    import too). `import course_lib as cl`, the package facade, is not an edge."""
    package = ["course_lib"] + (["recipes"] if name.startswith("recipes.") else [])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            parts = base + (node.module.split(".") if node.module else [])
            if parts[:1] != ["course_lib"]:
                continue
            targets = [parts[1:]] if len(parts) > 1 else []
            targets += [parts[1:] + [alias.name] for alias in node.names]
            for t in targets:
                dotted = ".".join(t)
                if dotted in module_files():
                    found.add(dotted)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                dotted = alias.name.removeprefix("course_lib.")
                if alias.name.startswith("course_lib.") and dotted in module_files():
                    found.add(dotted)
    return found - {name}


@pytest.fixture(scope="module")
def graph():
    return {name: imports_of(path, name) for name, path in module_files().items()}


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
    unknown = set(graph) - NOTEBOOK_SIDE - RANK_SIDE - {f"recipes.{r}" for r in RECIPES} - {"keras_precision"}
    assert not unknown, f"new module(s) {sorted(unknown)}: say which side each is on"
    for start in sorted((RANK_SIDE | {f"recipes.{r}" for r in RECIPES}) & set(graph)):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        assert not seen & NOTEBOOK_SIDE, f"{start} (rank-side) imports {sorted(seen & NOTEBOOK_SIDE)} (notebook-side)"


def test_recipes_import_without_side_effects_and_have_a_main_and_a_config():
    code = ("import sys, importlib; sys.argv = ['x', '--no-such-flag']\n"
            "import torch.distributed as dist\n"
            f"for name in {RECIPES!r}:\n"
            "    m = importlib.import_module('course_lib.recipes.' + name)\n"
            "    assert callable(m.main) and hasattr(m, 'Config'), name\n"
            "assert not dist.is_initialized()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "", f"importing a recipe printed: {done.stdout[:500]}"


def flags(recipe: str) -> set[str]:
    import importlib

    config = importlib.import_module(f"course_lib.recipes.{recipe}").Config
    return {o for a in config.parser()._actions for o in a.option_strings if o.startswith("--")}


def test_every_recipe_speaks_one_flag_vocabulary():
    from course_lib.config import size_fields

    size = {"--" + f.replace("_", "-") for f in size_fields()}
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


def test_importing_the_library_stays_light():
    code = ("import sys, course_lib as cl\n"
            "heavy = [m for m in ('tensorflow', 'IPython', 'ipywidgets', 'deepspeed', 'datasets', 'peft') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "assert cl.checkpoint.is_complete and cl.zero.prepare and cl.data.pack and cl.backends.pick\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
