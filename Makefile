# The workbook's commands. `make run` executes every chapter; `make test` is what CI runs.
#   make run [PROFILE=cpu|gpu] [ONLY=03] [SET="steps=3 model_path=/models/x"]    make test [TEST_JOBS=2]    make test-fast    make lab [PORT=8888] (token: JUPYTER_TOKEN or generated)
#   make run PROFILE=cpu JOBS=2: two chapters at a time where the chapters' checks allow it (course_lib/workbook/runner.py)
#   make run RECORD=1: claims recorded, not asserted (new hardware: every cell runs, the report lists what missed)
#   make run BUSY=1: one core kept busy by another process the whole time (what the asserted claims must survive)
# Everything installs itself into .venv on first use (and again when pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROFILE ?= auto
ONLY ?=
# papermill parameters for the chapters (course_lib.workbook.runner --set): SET="name=value name2=value2"
SET ?=
# make install: pyproject.toml's extras for the course in Jupyter, TensorFlow, the book and the tests, at the
# versions tested together (constraints.txt). TensorFlow's build follows the machine: the CUDA one where an
# NVIDIA GPU answers, else the CPU one.
EXTRA ?= $(if $(shell nvidia-smi -L 2>/dev/null),gpu,cpu)
# Elsewhere than this course's machines, PyPI's torch is the CUDA build: a CPU-only machine can
# point TORCH_INDEX at https://download.pytorch.org/whl/cpu to get the small CPU build instead.
TORCH_INDEX ?=
STAMP := $(VENV)/.installed-$(EXTRA)

.PHONY: install run test test-rerun test-fast lab clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -e ".[course,$(EXTRA),book,test]" -c constraints.txt
	$(BIN)/python -m ipykernel install --sys-prefix --name llm-course --display-name "Python (LLM course)"
	touch $@

run: install
	$(BIN)/python -m course_lib.workbook.runner --profile $(PROFILE) $(if $(ONLY),--only $(ONLY)) $(if $(SET),--set '$(subst ','\'',$(SET))') $(if $(RECORD),--record) $(if $(BUSY),--busy)

# two tests at a time (pytest-xdist; tests/conftest.py keeps the real-shape runs and timed chapters alone); 0: in-process
TEST_JOBS ?= 2
test: install
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadgroup -m "not rerun"

# chapters 01-04 run twice in one kernel, as a learner reruns them after an edit (tests/test_rerun.py; about 4 min on
# 2 cores; .ci/run runs it after make test)
test-rerun: install
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadgroup -m rerun

# the inner loop (under 5 min on 2 cores): every test not marked slow: the library, the launchers, chapter 00, one
# 2-rank launch of DDP, ZeRO-3 and FSDP2; `make test` runs these and the rest (every chapter, the real shape, the browser)
test-fast: install
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadgroup -m "not slow"

lab: install
	$(BIN)/python -m course_lib.workbook.lab $(if $(PORT),--port $(PORT))

clean:
	rm -rf build

# What an offline GPU machine lacks (tools/gpu_device.txt), for `bash tools/gpu_run.sh` there: the wheels and Qwen's
# tokenizer into .whl/, listed with their sizes in .whl/MANIFEST.txt. WITHOUT=bitsandbytes saves 41 MiB.
.PHONY: gpu-wheels
gpu-wheels: install
	$(BIN)/python tools/gpu_wheels.py $(if $(WITHOUT),--without $(WITHOUT))

# The CPU image built from docker/Dockerfile and the whole workbook run inside it (docker/image_test.py:
# needs Docker, or root to start dockerd; about 20 min from scratch). COLD=1: from scratch.
#   make image-test [ONLY=00] [COLD=1] [TORCH_INDEX=...]    (runs with .venv's Python if there is one)
.PHONY: image-test
image-test:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) docker/image_test.py $(if $(ONLY),--only $(ONLY)) $(if $(COLD),--cold) $(if $(TORCH_INDEX),--torch-index $(TORCH_INDEX))

# The SFT recipe against HF Trainer, side by side, at Qwen2.5-0.5B's shape (course_lib/workbook/bench.py; under 10 min on
# 2 CPU cores): target tokens/s, processed tokens/s, s/step, peak memory, loss, the ratio -> build/results/bench_*.json.
# BENCH="--shape tiny", "--backend ddp|fsdp", "--steps 20", "--ablate" (each speed path alone: longer), "--no-compile".
.PHONY: bench
bench: install
	$(BIN)/python -m course_lib.workbook.bench $(BENCH)
