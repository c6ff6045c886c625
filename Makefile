# The two commands a newcomer runs: `make demo` and `make test`. Each creates .venv and installs
# what it needs (idempotent: re-runs only when this file, pyproject.toml, setup.py or the C++
# sources change).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kiln-installed
NATIVE_SRC := $(wildcard kiln/tokenizer/csrc/*.cpp kiln/tokenizer/csrc/*.h)

.PHONY: demo demo-image storyteller venv test test-kernels test-all llamacpp test-llamacpp mutants lint bench-tokenizer bench-model bench-attention bench-data clean

$(STAMP): Makefile pyproject.toml setup.py $(NATIVE_SRC)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,kernels,data,ray,eval,scaling,serve,gguf,image]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kiln demo

# From nothing to a served chat model: `kiln demo --chat` (30 min on 2 cores; a second `make
# storyteller` resumes a killed run or reuses a finished one), then the server and its page.
storyteller: $(STAMP)
	if [ -f runs/storyteller/stages.json ]; then $(VENV)/bin/kiln demo --chat --out runs/storyteller --resume; \
	else $(VENV)/bin/kiln demo --chat --out runs/storyteller; fi
	$(VENV)/bin/kiln serve $$(cat runs/storyteller/report/summary.json | $(PY) -c 'import json,sys; print(json.load(sys.stdin)["chat_model"])')

# Scenes -> VQ-VAE -> DiT, scored by a checker on unseen compositions: `kiln demo --image` (15 min
# on 2 cores; a second `make demo-image` resumes a killed run or reuses a finished one).
demo-image: $(STAMP)
	if [ -f runs/demo-image/stages.json ]; then $(VENV)/bin/kiln demo --image --out runs/demo-image --resume; \
	else $(VENV)/bin/kiln demo --image --out runs/demo-image; fi

test: $(STAMP)
	KILN_REQUIRE_NATIVE=1 KILN_REQUIRE_SHARED=1 $(PY) -m pytest -q -m "not slow"

# The kernel-sensitive tests (marker `kernels`) once per CPU-kernel setting and torch thread
# count, each its own process; a table of tests × cells (docs/testing.md).
test-kernels: $(STAMP)
	KILN_REQUIRE_NATIVE=1 KILN_REQUIRE_SHARED=1 $(PY) tools/test_kernels.py --threads 1,2

# llama.cpp (llama-cpp-python, the llamacpp extra) for the GGUF parity tests (marker llamacpp) and
# bench/serve.py's llama.cpp columns. Built from source; GGML_NATIVE=OFF so the build (and the
# wheel pip caches) runs on any x86-64 CPU, not only the one that built it. pip reuses its cached
# wheel on a machine that built it once (seconds); a first build takes minutes (docs/export.md).
llamacpp: $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(PY) -m pip install -q -e '.[llamacpp]'

test-llamacpp: llamacpp
	KILN_REQUIRE_SHARED=1 $(PY) -m pytest -q -m llamacpp

test-all: $(STAMP)
	KILN_REQUIRE_NATIVE=1 KILN_REQUIRE_SHARED=1 $(PY) -m pytest -q

# Break one behaviour at a time (LR schedule, clipping, val loss, resume, mixing, filters) and
# check that a default test fails for each; see tools/mutants.py.
mutants: $(STAMP)
	$(PY) tools/mutants.py

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench-tokenizer: $(STAMP)
	$(PY) -m pip install -q -e '.[dev,kernels,bench]'
	$(PY) bench/tokenizer.py

bench-model: $(STAMP)
	$(PY) -m pip install -q -e '.[dev,kernels,bench]'
	$(PY) bench/model.py

bench-data: $(STAMP)
	$(PY) -m pip install -q -e '.[dev,kernels,data,bench]'
	$(PY) bench/data.py

bench-attention: $(STAMP)
	$(PY) bench/attention.py

clean:
	rm -rf build kiln/tokenizer/_native*.so
