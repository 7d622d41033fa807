PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
DEMO_ARGS ?=

.PHONY: install test demo lint bench

$(VENV)/.installed: pyproject.toml scripts/install.sh
	test -x $(VPY) || $(PY) -m venv $(VENV)
	scripts/install.sh $(VPY) "worker,triton,dev"
	touch $@

install: $(VENV)/.installed

test: install
	$(VENV)/bin/ruff check .
	scripts/typecheck.sh $(VPY)
	$(VENV)/bin/mkdocs build --strict --quiet  # the docs site: a broken link or anchor fails
	$(VPY) -m pytest -q -ra

# The embedded job server, a worker and the sample batch through the queue (scripts/demo.sh --help);
# e.g. make demo DEMO_ARGS="--model HuggingFaceTB/SmolLM2-360M-Instruct".
demo: install
	PYTHON=$(VPY) scripts/demo.sh $(DEMO_ARGS)

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(VPY) bench/throughput.py
