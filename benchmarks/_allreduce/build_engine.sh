#!/bin/sh
# Compiles the KungFu engine (cc/, no TensorFlow, no kf_ops/) into one shared library that exposes the C API
# of cc/c_api.h, for worker_engine.py: the allreduce benchmark's `engine` system, which runs where neither
# TensorFlow nor the kungfu package is installed. One g++ command, so it needs no make and no pip; the
# Makefile's build/cc/libkungfu_engine.so target runs this script too.
#
#     benchmarks/_allreduce/build_engine.sh OUTPUT.so        (CXX=clang++ to pick another compiler)
#
# The sources are the engine's part of the C++ test binary's (build/cc/kungfu_cc_tests, less cc/tests), the
# same globs as setup.py's and cc/BUILD's engine. The optimisation flags are setup.py's OPT_FLAGS, so the
# figures compare with those of the library pip builds (the `kungfu (engine)` series).
set -eu
out=${1:?usage: build_engine.sh OUTPUT.so}
root=$(cd "$(dirname "$0")/../.." && pwd)
exec "${CXX:-g++}" -std=c++17 -O3 -DNDEBUG -fPIC -pthread -Wall -shared -I"$root" -o "$out" \
    "$root"/cc/*.cc "$root"/cc/transport/*.cc "$root"/cc/collective/*.cc "$root"/cc/p2p/*.cc
