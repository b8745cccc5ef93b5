# edgebroker: an index of one-line targets; the work is done in tools/.
# Every target sets itself up first (make venv: .venv, pinned deps, mosquitto).

BOARD  ?= boards/host.json
PORT   ?= 1883
INTERP ?= cpython
VENV   := .venv

.PHONY: venv run test bench bench-pipeline pipeline bench-store bench-bridge fuzz bench-slowsub lint clean measure-memory board-reference

venv:  ## .venv with pinned deps + editable tools, mosquitto (no-op when done)
	bash tools/setup.sh

run: venv  ## broker in the foreground: make run [BOARD=esp32|path/to/profile.json] [PORT=...] [INTERP=micropython]
	exec $(VENV)/bin/edgebroker run --board $(BOARD) --port $(PORT) --interpreter $(INTERP)

test: venv  ## host tests, both interpreters and both servers, 4 workers by file (fails on "no tests collected" too)
	$(VENV)/bin/pytest -p no:cacheprovider -n 4 --dist loadfile host_tests

bench: venv  ## benchmarks: poll and asyncio servers on both interpreters vs mosquitto, all scenarios incl. the flash store, then the bridge's (~11 minutes)
	$(VENV)/bin/python -m edgebroker_tools.bench
	$(VENV)/bin/python -m edgebroker_tools.bench_bridge --json build/bench-bridge.json

bench-slowsub: venv  ## acknowledged QoS 1 messages lost for a slow subscriber (max_queued 100), edgebroker vs mosquitto
	$(VENV)/bin/python -m edgebroker_tools.bench_slowsub

fuzz: venv  ## the engine fuzzer's long mode: 1,000,000 mutated packets per interpreter (make test runs 60,000)
	$(VENV)/bin/python -m edgebroker_tools.fuzz

bench-store: venv  ## flash-store benchmarks only: write amplification, open time, heap per message, 20,000 retained to Receive Maximum 10
	$(VENV)/bin/python -m edgebroker_tools.bench --only store-wear,store-open,store-heap,retained-rm10

bench-bridge: venv  ## bridge to an upstream mosquitto vs a mosquitto edge bridge: forwarding, 50,000-message drain, SIGKILL mid-drain, heap and flash per queued message
	$(VENV)/bin/python -m edgebroker_tools.bench_bridge --json build/bench-bridge.json

bench-pipeline: venv  ## fleet pipeline at 20x10x2, 1,000x200x3, 10,000x200x3 (6.3 M rows), 20,000x200x3 on local[2], each beside a floor job (read + write the same snapshots)
	$(VENV)/bin/python -m edgebroker_tools.fleet.bench

pipeline: venv  ## fleet pipeline on synthetic data: synth (small) -> build (with progress) -> report, in build/pipeline/ (report.html there); prints its real duration
	@start=$$(date +%s); rm -rf build/pipeline \
	&& $(VENV)/bin/edgebroker fleet synth --gateways 200 --topics 50 --snapshots 3 --out build/pipeline/snapshots \
	&& $(VENV)/bin/edgebroker fleet build --snapshots build/pipeline/snapshots --out build/pipeline/warehouse --master 'local[2]' \
	&& $(VENV)/bin/edgebroker fleet report build/pipeline/warehouse \
	&& echo "make pipeline: $$(( $$(date +%s) - start )) s in all"

measure-memory: venv  ## heap costs under the MicroPython unix port, then 32-bit ratios under Node's WebAssembly MicroPython -> boards/memory_costs.json
	$(VENV)/bin/python -m edgebroker_tools.measure && $(VENV)/bin/python -m edgebroker_tools.measure32

board-reference: venv  ## docs/board-reference.md from boards/schema.json (a test checks it)
	$(VENV)/bin/edgebroker config reference

.PHONY: build flash
build: venv  ## dist/<board>/: .mpy, boot.py, main.py, board.json (+ ROMFS image), size report: make build BOARD=esp32
	$(VENV)/bin/edgebroker build $(BOARD)

flash: venv  ## build if stale, copy, verify by hash, soft-reset: make flash BOARD=esp32 PORT=/dev/ttyUSB0
	$(VENV)/bin/edgebroker flash $(BOARD) --port $(PORT)

lint: venv  ## ruff check + format check over tools/, lib/ and firmware/ (pyproject.toml's profile); mypy --strict over tools/
	$(VENV)/bin/ruff check tools lib firmware && $(VENV)/bin/ruff format --check tools lib firmware && $(VENV)/bin/mypy --strict tools

clean:  ## caches and build leftovers (keeps .venv and data/)
	rm -rf build dist tools/*.egg-info .mypy_cache .ruff_cache .pytest_cache
	find . -path ./.venv -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
