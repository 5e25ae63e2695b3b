# The README's two commands: `make demo` and `make test` (each installs what it needs).
PYTHON ?= python3
# setup.cfg declares torch as a range (the versions the suite has run on). When torch is
# missing, this pin is installed; which build (CPU or CUDA) pip picks for it depends on your
# package index. Override it, e.g. `make TORCH=torch test`.
TORCH ?= torch==2.13.0
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check
# pip builds the project without build isolation (offline, with what is installed) only when
# this interpreter's setuptools can build wheels by itself (>= 70.1; torch >= 2.13 brings one).
# Otherwise (a fresh venv's setuptools 65 without `wheel`, or no setuptools at all, as in
# Python 3.12+ venvs) pip fetches setuptools into an isolated build environment.
CAN_BUILD := import setuptools, sys; sys.exit(tuple(int(p) for p in setuptools.__version__.split(".")[:2]) < (70, 1))
BUILD_FLAGS = $$($(PYTHON) -c '$(CAN_BUILD)' 2>/dev/null && echo --no-build-isolation)

# The install is recorded per interpreter, not per checkout: a stamp named after the hash of
# the interpreter's sys.prefix (a second venv in the same clone gets its own install), made
# again when that interpreter finds no torch or no installed remote_module (a venv deleted and
# made again at the same path; the checkout's own directory does not count).
STAMP := .install-stamp-$(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha256(sys.prefix.encode()).hexdigest()[:12])' 2>/dev/null)
INSTALLED := import importlib.util as u, sys; sys.path[:] = [p for p in sys.path if p not in ("", ".")]; sys.exit(not (u.find_spec("torch") and u.find_spec("remote_module")))
ifneq ($(shell $(PYTHON) -c '$(INSTALLED)' 2>/dev/null && echo yes),yes)
.PHONY: $(STAMP)
endif

.PHONY: install demo demo-hybrid test lint bench

$(STAMP): setup.cfg pyproject.toml
	@$(PYTHON) -c "import torch" 2>/dev/null || { echo "installing $(TORCH) (once for this Python; a few minutes, quietly)..."; $(PIP) "$(TORCH)"; }
	$(PIP) $(BUILD_FLAGS) -e ".[test,demo]"
	touch $@

install: $(STAMP)

# The demo's own options, e.g. `make demo ARGS="--mode sync --steps 300"` (`make demo ARGS=--help`
# lists them), or without make: python -m remote_module.demos.dlrm --mode sync
ARGS ?=

# The main job: a DLRM-style click model on 2 parameter servers + 2 trainers (remote_module/demos/dlrm.py).
demo: $(STAMP)
	$(PYTHON) -m remote_module.demos.dlrm $(ARGS)

# The first demo: a hybrid model (remote EmbeddingBag + local Linear) on a local 2-process world.
demo-hybrid: $(STAMP)
	$(PYTHON) -m remote_module.demos.hybrid $(ARGS)

# Two pytest processes (pytest-xdist; a file's tests stay in one process, the files that start
# many processes first, see tests/conftest.py), most of a test's time being waits (deadlines,
# worlds starting). About 1,600 tests: 447 s on 2 cores at load ~3 (Dec 2026); 12-20 minutes
# at load 4-13, and 40-60 minutes beside 18 busy loops, were seen on the same kind of machine.
# One process (slower):
#   make TEST_FLAGS= test
TEST_FLAGS ?= -n 2 --dist loadfile --no-loadscope-reorder
test: $(STAMP)
	$(PYTHON) -m pytest $(TEST_FLAGS)

# Static checks with ruff (its rules: [tool.ruff] in pyproject.toml).
lint: $(STAMP)
	$(PYTHON) -m ruff check .

# bench_network needs root (simulated machines: network namespaces); it says so and skips without.
bench: $(STAMP)
	$(PYTHON) -m tests.benchmarks.bench_transport
	$(PYTHON) -m tests.benchmarks.bench_remote_module
	$(PYTHON) -m tests.benchmarks.bench_pipeline
	$(PYTHON) -m tests.benchmarks.bench_sharded
	$(PYTHON) -m tests.benchmarks.bench_ps
	$(PYTHON) -m tests.benchmarks.bench_embedding
	$(PYTHON) -m tests.benchmarks.bench_step_cpu
	$(PYTHON) -m tests.benchmarks.bench_dlrm
	$(PYTHON) -m tests.benchmarks.bench_admission
	$(PYTHON) -m tests.benchmarks.bench_table_memory
	$(PYTHON) -m tests.benchmarks.bench_shard_checkpoints
	$(PYTHON) -m tests.benchmarks.bench_checkpoint_cost
	$(PYTHON) -m tests.benchmarks.bench_batching
	$(PYTHON) -m tests.benchmarks.bench_failover
	$(PYTHON) -m tests.benchmarks.bench_network
