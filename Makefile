PYTHON ?= python

.PHONY: install test demo

install:
	$(PYTHON) -m pip install -e ".[dev]"

# Two processes (pytest-xdist): each test module in one of them (its fixtures made once), modules side by side
# (tests/conftest.py). Their torch threads, and the Ray workers of the job tests, outnumber the cores: OpenMP threads
# that sleep at a barrier instead of spinning leave the cores to the others (the job tests ~15% faster on 2 cores).
test:
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(PYTHON) -m pytest -q -n 2 --dist loadgroup --durations=15

demo:
	specrun generate --model smollm2 --prompt "Once upon a time" --max-tokens 200

.PHONY: proxy
# Train the proxy model (+ draft heads) for `specrun bench`; cached in $SPECRUN_CACHE/proxy-v1 (~/.cache/specrun/proxy-v1).
proxy:
	$(PYTHON) bench/proxy_model.py --minutes 20

.PHONY: gpu-check
# The CUDA path proved on a lent GPU machine in one command (docs/gpu-check.md); DEVICE=cpu: the dry run on tiny shapes.
DEVICE ?= cuda
OUT ?= gpu-check-out
gpu-check:
	$(PYTHON) -m specrun.bench.gpu_check --device $(DEVICE) --out $(OUT) $(if $(BUDGET),--budget $(BUDGET))
