# The README's commands. Each installs what it needs into .venv first (idempotent).
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed
PYTEST_ARGS ?=
# The suite runs in two pytest-xdist processes, each taking a whole file at a time (a module's
# stack fixture starts once). It is mostly one core of Python at a time (1.1 cores busy on
# average, one process), so two take ~0.6 of the wall time on 2 cores; running beside each
# other they also put every test under CPU load, which is how a tensor-parallel KV-save race
# was found. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

.PHONY: run test setup proto bench gpu-check clean

run: setup
	.venv/bin/pdserve up --mode disagg --model smollm2

# No rerun: a red test fails the run. (The old startup flake was fork() with a preexec_fn in a
# threaded test process; children now start through services/exec_tied.py, never a preexec_fn.)
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

proto: setup
	bash scripts/gen_proto.sh

bench: setup
	.venv/bin/pdserve bench offline --num-prompts 64 --input-len 256 --output-len 128

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf .venv build *.egg-info
