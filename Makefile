PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python

.PHONY: install test demo lint bench

$(VENV)/.installed: pyproject.toml scripts/install.sh
	test -x $(VPY) || $(PY) -m venv $(VENV)
	scripts/install.sh $(VPY) "triton,dev"
	touch $@

install: $(VENV)/.installed

test: install
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest -q -ra

demo: install
	$(VENV)/bin/sluice generate cli/samples/demo.jsonl -o demo-results.jsonl --max-tokens 64
	head -n 3 demo-results.jsonl

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(VPY) bench/throughput.py
