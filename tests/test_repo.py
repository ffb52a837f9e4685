"""Conventions of the repository: notebooks stored clean, one dependency list in three places."""
import json
import re
import tomllib

import pytest

from course_lib.paths import REPO_ROOT
from course_lib.paths import all_notebooks

NOTEBOOKS = all_notebooks()


def _name(req: str) -> str:
    return re.split(r"[<>=!\[ ;]", req, maxsplit=1)[0].lower()


def test_there_are_chapters():
    assert NOTEBOOKS and NOTEBOOKS[0].name.startswith("00_")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_clean_and_parameterized(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert not any(c.get("outputs") or c.get("execution_count") for c in code), "outputs committed: strip them"
    assert "parameters" in code[0]["metadata"].get("tags", []), "first code cell must be tagged 'parameters'"
    assert re.search(r"^profile\s*=", "".join(code[0]["source"]), re.M), "the parameters cell must set `profile`"
    assert nb["metadata"]["kernelspec"]["name"] == "llm-course"


def _pyproject():
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def test_environment_yml_installs_what_make_install_does():
    """No list of its own: the project's extras, with the constraints `make install` uses."""
    text = (REPO_ROOT / "environment.yml").read_text()
    pip_block = text.split("- pip:", 1)[1]
    listed = [line.strip()[2:].strip() for line in pip_block.splitlines() if line.strip().startswith("- ")]
    make = (REPO_ROOT / "Makefile").read_text()
    assert "-c constraints.txt" in make and '-e ".[course,$(EXTRA),book,test]"' in make
    assert listed == ["-c constraints.txt", "-e .[course,cpu,book,test]"]
    extras = _pyproject()["optional-dependencies"]
    assert {"course", "cpu", "gpu", "book", "test"} <= set(extras)


def test_constraints_pin_every_requirement_within_its_range():
    """constraints.txt (the versions tested together) holds a version of each requirement, inside pyproject's range."""
    from packaging.requirements import Requirement

    pins = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[_name(name).replace("_", "-")] = version.strip()
    project = _pyproject()
    for extra, reqs in [("", project["dependencies"])] + [(k, v) for k, v in project["optional-dependencies"].items()
                                                          if k != "gpu"]:  # the CUDA build of TensorFlow: not here
        for line in reqs:
            req = Requirement(line)
            name = req.name.lower().replace("_", "-")
            assert name in pins, f"constraints.txt has no {name} ({extra or 'dependencies'})"
            assert req.specifier.contains(pins[name]), f"constraints.txt's {name}=={pins[name]} is outside {line}"


def test_every_dependency_is_bounded():
    project = _pyproject()
    for req in project["dependencies"] + sum(project["optional-dependencies"].values(), []):
        assert re.search(r"[<=>]=|<", req), f"{req} has no version bound"
