# rlserve: `make demo` and `make test` each set up what they need (.venv via scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup test test-fast demo bench protos lock clean

setup:
	@scripts/setup.sh

# The whole suite: unit, distributed (gloo), engines (vLLM CPU) and integration (one shared local Ray cluster),
# on TEST_WORKERS pytest-xdist workers: the integration tests in order on one, every other module whole on any.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=25

# Without the shared Ray cluster.
test-fast: setup
	$(PY) -m pytest tests -m "not integration"

# Local cluster -> SFT warm start + async GRPO on the tiny model -> held-out reward before/after.
demo: setup
	@scripts/demo.sh

bench: setup
	@scripts/bench/run_all.sh

# Regenerate the gRPC stubs after editing protos/ (tests fail when they are stale).
protos: setup
	$(PY) -m rlserve.protogen

# Re-pin requirements/constraints.txt from the current .venv.
lock: setup
	@(echo "# The lock: every package of the CPU environment at the version that was tested."; \
	  echo "# Regenerate with 'make lock' after changing requirements/*.txt."; \
	  $(PY) -m pip freeze --exclude-editable) > requirements/constraints.txt

clean:
	rm -rf .venv runs .pytest_cache .hypothesis
