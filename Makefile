# The README's two commands: `make demo` and `make test` (each installs what it needs).
PYTHON ?= python3
# setup.cfg declares torch as a range (torch>=2.4). When torch is missing, this pin picks the
# small CPU wheel instead of a multi-GB CUDA build; override it, e.g. `make TORCH=torch test`.
TORCH ?= torch==2.13.0
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: install demo demo-hybrid test bench

.install-stamp: setup.cfg pyproject.toml
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH)"
	$(PIP) --no-build-isolation -e ".[test,demo]"
	touch $@

install: .install-stamp

# The main job: a DLRM-style click model on 2 parameter servers + 2 trainers (remote_module/dlrm_demo.py).
demo: .install-stamp
	$(PYTHON) -m remote_module.dlrm_demo

# The first demo: a hybrid model (remote EmbeddingBag + local Linear) on a local 2-process world.
demo-hybrid: .install-stamp
	$(PYTHON) -m remote_module.demo

test: .install-stamp
	$(PYTHON) -m pytest

bench: .install-stamp
	$(PYTHON) -m tests.benchmarks.bench_remote_module
	$(PYTHON) -m tests.benchmarks.bench_pipeline
	$(PYTHON) -m tests.benchmarks.bench_sharded
	$(PYTHON) -m tests.benchmarks.bench_ps
	$(PYTHON) -m tests.benchmarks.bench_embedding
