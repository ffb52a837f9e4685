"""Conventions of the repository: notebooks stored clean, one dependency list in three places."""
import json
import re
import tomllib

import pytest

from course_lib.results import REPO_ROOT
from course_lib.runner import all_notebooks

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


def test_environment_yml_mirrors_pyproject():
    project = _pyproject()
    expected = project["dependencies"] + project["optional-dependencies"]["cpu"] + project["optional-dependencies"]["test"]
    text = (REPO_ROOT / "environment.yml").read_text()
    pip_block = text.split("- pip:", 1)[1]
    listed = [line.strip()[2:].strip() for line in pip_block.splitlines() if line.strip().startswith("- ")]
    assert sorted(listed) == sorted(expected)


def test_every_dependency_is_bounded():
    project = _pyproject()
    for req in project["dependencies"] + sum(project["optional-dependencies"].values(), []):
        assert re.search(r"[<=>]=|<", req), f"{req} has no version bound"
