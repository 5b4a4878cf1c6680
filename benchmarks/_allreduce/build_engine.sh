#!/bin/sh
# Compiles the KungFu engine (cc/, no TensorFlow, no kf_ops/) into one shared library that exposes the C API
# of cc/c_api.h, for worker_engine.py: the allreduce benchmark's `engine` system, which runs where neither
# TensorFlow nor the kungfu package is installed. Plain sh, g++ and xargs, so it needs no make and no pip; the
# Makefile's build/cc/libkungfu_engine.so target runs this script too.
#
#     benchmarks/_allreduce/build_engine.sh OUTPUT.so        (CXX=clang++ to pick another compiler,
#                                                              JOBS=N to compile N files at once; default nproc)
#
# The sources are the engine's part of the C++ test binary's (build/cc/kungfu_cc_tests, less cc/tests), the
# same globs as setup.py's and cc/BUILD's engine. The optimisation flags are setup.py's OPT_FLAGS, so the
# figures compare with those of the library pip builds (the `kungfu (engine)` series). Each source compiles
# on its own core, then one link: 17-25 s on 2 cores, against 45 s as one g++ command.
set -eu
out=${1:?usage: build_engine.sh OUTPUT.so}
root=$(cd "$(dirname "$0")/../.." && pwd)
cxx=${CXX:-g++}
jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}
# Objects beside the output, so that what a SIGKILL leaves lies in the caller's folder (allreduce.py's is
# temporary); stop the build by its process group (as Ctrl-C and allreduce.py do): the compilers are xargs'.
objs=$(mktemp -d "$(dirname "$out")/.engine_objs.XXXXXX")
trap 'rm -rf "$objs"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# Object names keep the folder (transport_x.o), so two sources with one file name cannot collide.
ls "$root"/cc/*.cc "$root"/cc/transport/*.cc "$root"/cc/collective/*.cc "$root"/cc/p2p/*.cc |
    xargs -P "$jobs" -I SRC sh -c 'rel=${1#"$2"/cc/}
        exec "$3" -std=c++17 -O3 -DNDEBUG -fPIC -pthread -Wall -I"$2" -c "$1" -o "$4/$(echo "$rel" | tr / _).o"' \
        sh SRC "$root" "$cxx" "$objs"
"$cxx" -shared -pthread -o "$out" "$objs"/*.o
