# edgebroker: an index of one-line targets; the work is done in tools/.
# Every target sets itself up first (make venv: .venv, pinned deps, mosquitto).

BOARD  ?= boards/host.json
PORT   ?= 1883
INTERP ?= cpython
VENV   := .venv

.PHONY: venv run test bench lint clean

venv:  ## .venv with pinned deps + editable tools, mosquitto (no-op when done)
	bash tools/setup.sh

run: venv  ## broker in the foreground: make run [BOARD=...] [PORT=...] [INTERP=micropython]
	exec $(VENV)/bin/edgebroker run --board $(BOARD) --port $(PORT) --interpreter $(INTERP)

test: venv  ## host tests, both interpreters (fails on "no tests collected" too)
	$(VENV)/bin/pytest -p no:cacheprovider host_tests

bench: venv  ## benchmarks
	$(VENV)/bin/python -m edgebroker_tools.bench

lint: venv  ## ruff + mypy --strict over tools/
	$(VENV)/bin/ruff check tools && $(VENV)/bin/ruff format --check tools && $(VENV)/bin/mypy --strict tools

clean:  ## caches and build leftovers (keeps .venv and data/)
	rm -rf build dist tools/*.egg-info .mypy_cache .ruff_cache .pytest_cache
	find . -path ./.venv -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
