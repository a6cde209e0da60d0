PYTHON ?= python

.PHONY: install test demo

install:
	$(PYTHON) -m pip install -e ".[dev]"

test:
	$(PYTHON) -m pytest -q --durations=15

demo:
	specrun generate --prompt "Once upon a time" --max-tokens 200
