# Single entry point. `make test` and `make demo` set up .venv themselves on a
# fresh machine and do nothing more on later runs (the stamp file).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-v1
# torch comes from the machine's local CPU wheel; any other spec would pull
# several GB of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
# Optional: torchft's own package, used only by the interop test and the
# benchmarks for comparison. Installed without its dependencies so it can't
# replace torch; a failure to get it only skips those comparisons.
TORCHFT_SPEC ?= torchft-nightly==2026.10.26
# What importing torchft's Python side needs (its otel module, loaded by its transports, CLI and
# Manager): without it the comparisons that run torchft (heal, chaos, recovery) would skip.
TORCHFT_RUNTIME := "opentelemetry-sdk>=1.39" "opentelemetry-exporter-otlp-proto-http>=1.39"

.PHONY: all venv bytecode slurm test test-fast compat demo demo-hsdp proto bench bench-ddp bench-recovery bench-heal bench-checkpoint bench-health bench-diloco browser clean help gpu-check gpu-wheels dashboard-screenshot

all: test

help:
	@echo "make test    set up .venv and run the whole test suite"
	@echo "make demo    set up .venv and run the demo (lighthouse + replica groups)"
	@echo "make demo-hsdp  the same with FSDP2 inside each group: kill one rank, heal shard by shard"
	@echo "make compat  run the tests shipped in torchft's wheel on torchft and on torchft_lite; print a table"
	@echo "make proto   regenerate torchft_lite/rpc/protocol from proto/torchft.proto"
	@echo "make bench   run benchmarks/lighthouse_bench.py (ours and torchft's)"
	@echo "make bench-ddp  run benchmarks/ddp_overhead_bench.py (Manager step overhead vs plain gloo DDP)"
	@echo "make bench-recovery  run benchmarks/recovery_bench.py (stall and rejoin after a SIGKILL, ours vs torchft)"
	@echo "make bench-heal  run benchmarks/heal_bench.py (state-dict transfer GB/s: ours, torchft's, loopback ceiling)"
	@echo "make bench-checkpoint  run benchmarks/checkpoint_bench.py (durable checkpoint overhead: ours, DCP async_save, torch.save)"
	@echo "make bench-health  run benchmarks/health_bench.py (non-finite guard and fingerprint cost per step, 100 MB and 1 GB)"
	@echo "make bench-diloco  run benchmarks/diloco_bench.py (DDP vs DiLoCo over a modelled slow link: bytes, wall time, loss)"
	@echo "make dashboard-screenshot  the front page's picture of the dashboard's timeline: a real job, a group killed and healed"
	@echo "make gpu-check  on a GPU machine, no venv: tests/gpu, 3 groups on one GPU with a kill, the CUDA heal; one table"
	@echo "make gpu-wheels download into .whl/ the wheels gpu-check installs there (a GPU machine without a network)"

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	-$(BIN)/python -m pip install --quiet --no-deps "$(TORCHFT_SPEC)" \
		|| echo "note: $(TORCHFT_SPEC) unavailable; torchft comparisons will be skipped"
	-$(BIN)/python -m pip install --quiet $(TORCHFT_RUNTIME) \
		|| echo "note: torchft's runtime imports unavailable; comparisons that run torchft will be skipped"
	touch $@

venv: $(STAMP)

# Chromium for the dashboard's browser test (Debian's package). Without root
# or a package mirror the browser tests skip and say why.
browser:
	@command -v chromium >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } || \
	  echo "note: chromium not installed; browser tests will be skipped"

# Slurm and munge (Debian's packages) for the Slurm recipe's test, which starts a private single-node
# Slurm as root. Without root or a package mirror that test skips and says why.
slurm:
	@{ command -v slurmctld && command -v slurmd && command -v munged; } >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      slurm-wlm munge >/dev/null) ; } || \
	  echo "note: slurm-wlm/munge not installed; the Slurm recipe's test will be skipped"

# Bytecode for the packages, as pip writes for an installed package: the suite starts hundreds of
# processes, and where PYTHONDONTWRITEBYTECODE is set each would compile every module from source.
# Quick when nothing changed.
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q lighthouse torchft_lite examples benchmarks tests >/dev/null

# Two pytest workers: most integration tests wait (heartbeats, timeouts, process start-up), so two
# halve the suite's wall time on two cores. A worker takes a whole file at a time (module fixtures,
# the chaos run's fixed network namespaces). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: $(STAMP) browser slurm bytecode
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL)

test-fast: $(STAMP) bytecode
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) -m "not slow and not browser"

# torchft's own test files, read from its installed wheel, run once on torchft and
# once on torchft_lite (tests/compat/run.py --help). torchft imports OpenTelemetry,
# which is not ours, so only this target installs it (its PGTransport's numpy is one
# of our dependencies). Skipped (exit 0) where torchft can't be installed; where it
# can, a broken harness fails the target, failing torchft_lite tests don't (see the report).
COMPAT_ARGS ?=
compat: $(STAMP)
	-$(BIN)/python -m pip install --quiet $(TORCHFT_RUNTIME)
	@if $(BIN)/python -m pip install --quiet --no-deps "$(TORCHFT_SPEC)"; then \
	  $(BIN)/python -m tests.compat.run --require-torchft $(COMPAT_ARGS); \
	else \
	  echo "note: $(TORCHFT_SPEC) unavailable; make compat skipped"; \
	fi

# The front page's picture of the dashboard: the timeline browser test (two train_ddp groups, one SIGKILLed and
# restarted, in headless Chromium) writes it where the variable says. About a minute.
DASHBOARD_SCREENSHOT ?= examples/screenshots/dashboard-timeline.png
dashboard-screenshot: $(STAMP) browser bytecode
	mkdir -p $(dir $(DASHBOARD_SCREENSHOT))
	TORCHFT_LITE_DASHBOARD_SCREENSHOT=$(abspath $(DASHBOARD_SCREENSHOT)) $(BIN)/python -m pytest -q \
		tests/integration/test_dashboard_timeline_browser.py

demo: $(STAMP) bytecode
	$(BIN)/python examples/demo.py

demo-hsdp: $(STAMP) bytecode
	$(BIN)/python examples/demo_hsdp.py

proto: $(STAMP)
	$(BIN)/python -m torchft_lite.rpc.protocol.generate

bench: $(STAMP)
	$(BIN)/python benchmarks/lighthouse_bench.py

# Survivors' stall and rejoin time after a SIGKILL, ours vs torchft's (same script).
bench-recovery: $(STAMP)
	$(BIN)/python benchmarks/recovery_bench.py

# Per-step cost of fault tolerance: two replica groups vs a plain gloo DDP loop.
bench-ddp: $(STAMP)
	$(BIN)/python benchmarks/ddp_overhead_bench.py

# Heal bandwidth between two processes: our transports, torchft's HTTPTransport, the loopback ceiling.
bench-heal: $(STAMP)
	$(BIN)/python -m benchmarks.heal_bench

# What durable checkpoints cost: step-time overhead, size, write and resume time, vs DCP and torch.save.
bench-checkpoint: $(STAMP)
	$(BIN)/python benchmarks/checkpoint_bench.py

bench-health: $(STAMP)
	$(BIN)/python benchmarks/health_bench.py

# Per-step DDP vs DiLoCo (sync every 10/50/100, quantized) between two groups over a modelled 100 MB/s link.
bench-diloco: $(STAMP)
	$(BIN)/python benchmarks/diloco_bench.py

# The GPU check (benchmarks/gpu_check.py) runs from a plain checkout on the machine's own Python and torch: no
# venv (a torch with CUDA is too big to bring). What that machine may lack is installed from .whl/ into
# GPU_SITE first: make gpu-wheels downloads it here, for Python 3.12 on x86-64 Linux, pinned to what .venv runs.
GPU_PYTHON ?= python3
GPU_SITE ?= /tmp/torchft-lite-gpu-site
GPU_CHECK_ARGS ?=
GPU_WHEELS_PYTHON ?= 3.12
GPU_WHEELS := hpack==4.2.0 protobuf==7.36.2 torchft-nightly==2026.10.26 \
	opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
	opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
	opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-http-transport==0.66b2 \
	opentelemetry-exporter-otlp-common==0.66b2 googleapis-common-protos==1.76.0

gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then \
	  echo "installing $$(ls .whl/*.whl | wc -l) wheel(s) from .whl/ into $(GPU_SITE)"; \
	  $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	    --target $(GPU_SITE) .whl/*.whl; \
	fi
	PYTHONPATH=$(CURDIR):$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

gpu-wheels:
	mkdir -p .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_WHEELS_PYTHON) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
	  -d .whl $(GPU_WHEELS)
	@du -sh .whl

clean:
	rm -rf $(VENV) build *.egg-info
