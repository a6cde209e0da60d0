PYTHON ?= python

.PHONY: install test demo

install:
	$(PYTHON) -m pip install -e ".[dev]"

test:
	$(PYTHON) -m pytest -q --durations=15

demo:
	specrun generate --model smollm2 --prompt "Once upon a time" --max-tokens 200

.PHONY: proxy
# Train the proxy model (+ draft heads) for `specrun bench`; cached in $SPECRUN_CACHE/proxy-v1 (~/.cache/specrun/proxy-v1).
proxy:
	$(PYTHON) bench/proxy_model.py --minutes 20
