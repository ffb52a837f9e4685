"""Every chapter, executed headless with the CPU profile through the same runner as `make run`."""
import pytest

from course_lib import runner


@pytest.mark.notebook
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("notebook", runner.all_notebooks(), ids=lambda p: p.stem)
def test_notebook_executes(notebook, notebook_times):
    outcome = runner.run(profile="cpu", only=notebook.stem)[0]
    notebook_times.append((outcome.notebook, outcome.status, outcome.seconds))
    assert outcome.status == "ok", f"{notebook.name} failed: {outcome.error}"
