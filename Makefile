# Build, test and CI entry points. CI runs `make test` (.ci/run) on a fresh Debian 12 machine as root.
#
#   make deps         apt and pip packages (each skipped when already there); every target below runs it
#                     first, once per top-level make
#   make build        pip install --no-build-isolation .   (kungfu/_kungfu.so + the Python package)
#   make cc-test      the engine tests, no TensorFlow: build/cc/kungfu_cc_tests
#   make cc-test-sanitize   the same tests under ASan+UBSan and under TSan (build/cc-asan, build/cc-tsan)
#   make build/cc/libkungfu_engine.so   the engine alone as a C API library, no TensorFlow
#                     (benchmarks/_allreduce/build_engine.sh; allreduce.py --systems=engine builds its own)
#   make bazel-build  bazel build //:kungfu_ops  -> build/bazel/_kungfu.so
#   make bazel-test   bazel test //cc:engine_test
#   make test         all of the above, then pytest tests/
#   make demo         kfrun -np 4 on examples/adaptive_batch.py (fixed small, fixed large and GNS-driven
#                     adaptive batch, ~2 min): prints the comparison, writes build/demo/adaptive_batch.{png,md}
#   make bench        benchmarks/allreduce.py, training.py and monitoring.py (write benchmarks/results/)

SHELL := /bin/bash
PYTHON ?= python3
CXX ?= g++
BAZEL ?= bazel
NPROC := $(shell nproc 2>/dev/null || echo 2)
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

# Python's headers, for the eager extension setup.py builds (python/kungfu/ops/_eager.cc): Debian's
# python3-dev where this Python has none (a Python of its own, like pyenv's, brings them).
PYTHON_HAS_HEADERS := $(shell $(PYTHON) -c 'import os, sysconfig; \
    print(os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null)
APT_PACKAGES := build-essential bazel-bootstrap openmpi-bin libopenmpi-dev iproute2 \
                $(if $(filter True,$(PYTHON_HAS_HEADERS)),,python3-dev)
PIP := $(PYTHON) -m pip --disable-pip-version-check
PIP_INSTALL := $(PIP) install --root-user-action=ignore
# Where pip puts console scripts (kfrun): pyenv's shims only see new ones after `pyenv rehash`.
SCRIPTS_DIR = $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
KFRUN = $(SCRIPTS_DIR)/kfrun

# mpirun (benchmarks, tests) refuses to run as root without these; CI runs as root on 2 cores.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1

# Every target installs what it needs first (a fresh machine lacks g++, bazel and even pip's wheel), but
# only once per top-level make: test, demo and bench run deps, then call the other targets with
# KF_DEPS_DONE=1, which sub-makes inherit.
DEPS := $(if $(KF_DEPS_DONE),,deps)
SUBMAKE = $(MAKE) --no-print-directory KF_DEPS_DONE=1

.PHONY: all deps deps-apt deps-pip build cc-test cc-test-sanitize bazel-build bazel-test test demo bench clean FORCE
all: build

# ---- dependencies ----------------------------------------------------------------------------

deps: deps-apt deps-pip

deps-apt:
	@missing="$$(for p in $(APT_PACKAGES); do \
	    dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done)"; \
	if [ -n "$$missing" ]; then \
	    echo "apt-get install" $$missing; \
	    $(SUDO) apt-get update -q && \
	    DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $$missing; \
	fi

deps-pip: deps-apt
	$(PIP_INSTALL) -q -r requirements.txt

# ---- the Python package (setup.py) -----------------------------------------------------------

build: $(DEPS)
	$(PIP_INSTALL) -q --no-build-isolation .
	@command -v pyenv >/dev/null && pyenv rehash || true

# ---- engine tests, no TensorFlow -------------------------------------------------------------
# The engine must not include TensorFlow, so this one target names its own -std.

CC_TEST_SRCS := $(wildcard cc/*.cc cc/transport/*.cc cc/collective/*.cc cc/p2p/*.cc cc/tests/*.cc)
CC_TEST_OBJS := $(patsubst %.cc,build/cc/obj/%.o,$(CC_TEST_SRCS))
CC_TEST_BIN := build/cc/kungfu_cc_tests
CC_TEST_FLAGS := -std=c++17 -O2 -pthread -Wall -I.

# Twice: as each test configures the engine (on a machine with few cores, no sender thread), then with
# the sender thread (cc/transport/sender.h) on in every engine the tests start.
cc-test: $(DEPS)
	@$(SUBMAKE) -j$(NPROC) $(CC_TEST_BIN)
	./$(CC_TEST_BIN)
	KUNGFU_SEND_THREAD=1 ./$(CC_TEST_BIN)

# Relink when the list of sources changes, not only when an object does.
build/cc/objects.txt: FORCE
	@mkdir -p $(@D)
	@echo '$(CC_TEST_OBJS)' | cmp -s - $@ || echo '$(CC_TEST_OBJS)' > $@

$(CC_TEST_BIN): $(CC_TEST_OBJS) build/cc/objects.txt
	$(CXX) $(CC_TEST_FLAGS) -o $@ $(CC_TEST_OBJS)

build/cc/obj/%.o: %.cc
	@mkdir -p $(@D)
	$(CXX) $(CC_TEST_FLAGS) -MMD -MP -c $< -o $@

-include $(CC_TEST_OBJS:.o=.d)

# The same tests under sanitizers, each build in its own directory (not part of `make test`):
# build/cc-asan (AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer) and build/cc-tsan
# (ThreadSanitizer). Any report fails the run.
SAN_KINDS := asan tsan
SAN_FLAGS_asan := -fsanitize=address,undefined -fno-omit-frame-pointer -O1 -g
SAN_FLAGS_tsan := -fsanitize=thread -O1 -g
SAN_ENV_asan := ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
SAN_ENV_tsan := TSAN_OPTIONS=second_deadlock_stack=1

cc-test-sanitize: $(DEPS)
	@$(SUBMAKE) -j$(NPROC) $(foreach k,$(SAN_KINDS),build/cc-$(k)/kungfu_cc_tests)
	$(foreach k,$(SAN_KINDS),$(SAN_ENV_$(k)) ./build/cc-$(k)/kungfu_cc_tests && \
	  KUNGFU_SEND_THREAD=1 $(SAN_ENV_$(k)) ./build/cc-$(k)/kungfu_cc_tests &&) true

define SAN_RULES
build/cc-$(1)/objects.txt: FORCE
	@mkdir -p $$(@D)
	@echo '$$(CC_TEST_SRCS)' | cmp -s - $$@ || echo '$$(CC_TEST_SRCS)' > $$@

build/cc-$(1)/kungfu_cc_tests: $$(patsubst %.cc,build/cc-$(1)/obj/%.o,$$(CC_TEST_SRCS)) build/cc-$(1)/objects.txt
	$$(CXX) $$(CC_TEST_FLAGS) $$(SAN_FLAGS_$(1)) -o $$@ $$(filter %.o,$$^)

build/cc-$(1)/obj/%.o: %.cc
	@mkdir -p $$(@D)
	$$(CXX) $$(CC_TEST_FLAGS) $$(SAN_FLAGS_$(1)) -MMD -MP -c $$< -o $$@

-include $$(patsubst %.cc,build/cc-$(1)/obj/%.d,$$(CC_TEST_SRCS))
endef
$(foreach k,$(SAN_KINDS),$(eval $(call SAN_RULES,$(k))))

# The engine alone (cc/ less cc/tests, no kf_ops/, no TensorFlow) as a shared library with the C API of
# cc/c_api.h, for ctypes: benchmarks/_allreduce/worker_engine.py. The compile commands live in the script so
# that a machine without make's other dependencies builds the same library.
ENGINE_LIB_DEPS := $(filter-out cc/tests/%,$(CC_TEST_SRCS) $(wildcard cc/*.h cc/*/*.h)) \
                   benchmarks/_allreduce/build_engine.sh

build/cc/libkungfu_engine.so: $(ENGINE_LIB_DEPS)
	@mkdir -p $(@D)
	CXX='$(CXX)' sh benchmarks/_allreduce/build_engine.sh $@

# ---- Bazel (offline; see third_party/bazel/README.md) ----------------------------------------

# The Python whose tf.sysconfig gives the flags (tools/tf_configure.bzl runs tools/tf_config.py).
BAZEL_FLAGS = --repo_env=PYTHON_BIN_PATH=$(shell $(PYTHON) -c 'import sys; print(sys.executable)') \
              --show_progress_rate_limit=10

bazel-build: $(DEPS)
	$(BAZEL) build $(BAZEL_FLAGS) //:kungfu_ops
	@mkdir -p build/bazel
	@rm -f build/bazel/_kungfu.so && cp bazel-bin/_kungfu.so build/bazel/_kungfu.so && chmod u+w build/bazel/_kungfu.so
	@echo "Bazel-built library: $(CURDIR)/build/bazel/_kungfu.so  (use it with KUNGFU_LIBRARY=<path>)"

bazel-test: $(DEPS)
	$(BAZEL) test $(BAZEL_FLAGS) //cc:engine_test

# ---- everything ------------------------------------------------------------------------------

# Steps run one after another even under make -j: each needs the one before.
# A Python test still running after 300 s (the slowest take about 100) prints every thread's stack
# (pytest's faulthandler_timeout) and goes on: a hang in CI then shows where it waits.
test: deps
	@$(SUBMAKE) build
	@$(SUBMAKE) cc-test
	@$(SUBMAKE) bazel-build bazel-test
	@$(PYTHON) -m pytest -q --durations=15 -o faulthandler_timeout=300 tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests under tests/" >&2; fi; exit $$rc

demo: deps
	@$(SUBMAKE) build
	$(KFRUN) -np 4 $(PYTHON) examples/adaptive_batch.py --out_dir=build/demo

bench: deps
	@$(SUBMAKE) build
	$(PYTHON) benchmarks/allreduce.py
	$(PYTHON) benchmarks/training.py
	$(PYTHON) benchmarks/monitoring.py
	$(PYTHON) benchmarks/policies.py

clean:
	rm -rf build dist *.egg-info python/*.egg-info
	-$(BAZEL) clean

FORCE:
