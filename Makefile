# pretrain-bench — the README's commands. `make demo` and `make test` install into .venv when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OPS_STAMP := $(VENV)/.cpu-ops-built
INSTALLED := $(STAMP) $(OPS_STAMP)
export PATH := $(CURDIR)/$(BIN):$(PATH)
TINY := --configfile config/tiny-cpu.yaml
TINY_NAME := tiny-cpu

.PHONY: install demo test check test-unit test-integration lint bench dry-run clean gpu-smoke gpu-smoke-cpu

install: $(INSTALLED)

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	# torch first: deepspeed's build imports it (hence --no-build-isolation, which keeps pip from pulling
	# a multi-GB CUDA torch into an isolated build environment).
	$(BIN)/python -m pip install --quiet torch==2.13.0 numpy==2.4.6
	# DeepSpeed's setup.py asks every op builder whether its op could be built, even with none to build
	# (DS_BUILD_OPS=0: ops compile on first use). Where torch sees a GPU but no CUDA toolkit is installed (CUDA_HOME
	# unset), fp_quantizer and the inference ops raise MissingCUDAException instead of answering no, which fails the
	# install; DS_IGNORE_CUDA_DETECTION=1 skips that toolkit check. No op here needs the toolkit.
	DS_BUILD_OPS=0 DS_IGNORE_CUDA_DETECTION=1 $(BIN)/python -m pip install --quiet --no-build-isolation -r requirements.txt
	# the pretrain_bench library itself (workflow_scripts/pretrain_bench), editable: the rules, bench/ and tests import it
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	# the torch this environment ended up with (a venv kept from before, or a pip that resolved another): refused in one
	# line naming the version to install, as `snakemake -n` refuses it
	$(BIN)/python -m pretrain_bench.config.checks
	# byte-compiled as pip compiles what it installs (an editable install is not): where PYTHONDONTWRITEBYTECODE is set,
	# every process would compile the package's modules again (measured: 0.20 → 0.13 CPU-s for the launcher's imports)
	$(BIN)/python -m compileall -q workflow_scripts > /dev/null
	touch $@

$(OPS_STAMP): $(STAMP)
	# DeepSpeed's CPU ops (shared-memory collectives, CPU Adam) compile on first use: build them once here, into
	# this environment's own extension cache (.venv/torch_extensions), instead of inside the first (timed) training job.
	$(BIN)/python -c "from pretrain_bench.train.launcher import build_cpu_ops, extension_build_root; \
	print('built', *build_cpu_ops(), 'in', extension_build_root())"
	touch $@

demo: $(INSTALLED)
	$(BIN)/snakemake --cores 2 --resources gpu=3 $(TINY) --printshellcmds
	# the README's "Reading the results": Snakemake's own report (every output wrapped in report()) and the log
	$(BIN)/snakemake --cores 2 --resources gpu=3 $(TINY) --report results/$(TINY_NAME)/report.zip
	tail -n 3 logs/$(TINY_NAME)/pretrain.log
	@echo ""
	@echo "Report: $(CURDIR)/results/$(TINY_NAME)/report/report.html"
	@echo "        $(CURDIR)/results/$(TINY_NAME)/report/report.md"
	@echo "        $(CURDIR)/results/$(TINY_NAME)/report.zip (snakemake --report)"
	@echo "Curves: tensorboard --logdir results/$(TINY_NAME)/train/tensorboard"

# pytest-xdist workers: the integration modules spend much of their time waiting (process start-up, collectives,
# the SLURM test's scheduler), which a second worker fills; tests/conftest.py decides which tests share a worker.
TEST_WORKERS ?= 2

test: $(INSTALLED) lint
	$(BIN)/python -m pytest tests -q -n $(TEST_WORKERS)

# The fast loop while editing: unit tests and the workflow lint (a few minutes on 2 cores). `make test` is the whole
# suite, what CI runs; `pytest -m pipeline|engine|slurm` picks one kind of integration test.
check: $(INSTALLED) lint docs
	$(BIN)/python -m pytest tests/unit -q -n $(TEST_WORKERS)

# The documentation site (mkdocs.yml, docs/) into site/: --strict fails on any warning (a broken link or anchor, a page
# missing from the nav); the config reference must be what schemas/config.schema.yaml generates now.
.PHONY: docs
docs: $(STAMP)
	$(BIN)/python docs/gen_config_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet -d site

test-unit: $(INSTALLED)
	$(BIN)/python -m pytest tests/unit -q

test-integration: $(INSTALLED)
	$(BIN)/python -m pytest tests/integration -q

# A throw-away SLURM cluster on this machine (installs Debian's slurm-wlm + munge when missing, as root), the tiny
# pipeline through profiles/slurm on it, one and two nodes; and two hand-launched "nodes" without a scheduler.
.PHONY: test-slurm
test-slurm: $(INSTALLED)
	$(BIN)/python -m pytest tests/integration/test_slurm.py tests/integration/test_multinode.py -q

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/snakemake --lint --cores 1 $(TINY)
	$(BIN)/snakemake --lint --cores 1

dry-run: $(INSTALLED)
	$(BIN)/snakemake -n --cores 32 --resources gpu=3

bench: $(INSTALLED)
	mkdir -p bench-results
	$(BIN)/python bench/bench_corpus.py bench-results/corpus.json
	$(BIN)/python bench/bench_tokens.py bench-results/tokens.json
	$(BIN)/python bench/bench_dag.py bench-results/dag.json
	$(BIN)/python bench/bench_trainer.py bench-results/trainer.json --model-class
	$(BIN)/python bench/bench_zero_overhead.py bench-results/zero-overhead.json
	$(BIN)/python bench/bench_compile.py bench-results/compile.json
	$(BIN)/python bench/bench_model_implementation.py bench-results/model-implementation.json
	$(BIN)/python bench/bench_pipeline.py bench-results/pipeline.json
	$(BIN)/python bench/bench_moe_vs_dense.py bench-results/moe-vs-dense.json

# The CUDA path on one GPU in a few minutes, nccl at world size 1: what config.yaml's pre-flight chooses for the
# source articles' box (today ZeRO-2 + CPU optimizer offload + activation checkpointing, fp16), ZeRO-3 + CPU optimizer
# offload in fp16 and ZeRO-2 bf16 on llama-1b, ZeRO-2 fp16 loss scaling, DDP fp16, FSDP bf16: tokens/s, MFU against
# the GPU's datasheet peak, peak memory against the memory model, in bench-results/gpu-smoke.json. Needs no CUDA
# toolkit; g++ only for the offloaded runs' CPU Adam, which it compiles on first use (so it skips make install's
# CPU-op build). Without GPUs it says why and exits 0; where nvidia-smi lists GPUs torch cannot use, it fails.
gpu-smoke: $(STAMP)
	$(BIN)/python bench/gpu_smoke.py bench-results/gpu-smoke.json

# The same runs on CPU (gloo, bf16 for fp16, peak RSS; MFU against a measured CPU peak), in
# bench-results/gpu-smoke-cpu.json: a crash in the smoke shows here first. `make test` runs a short form.
gpu-smoke-cpu: $(INSTALLED)
	$(BIN)/python bench/gpu_smoke.py bench-results/gpu-smoke-cpu.json --device cpu

clean:
	rm -rf results logs benchmarks .snakemake bench-results
