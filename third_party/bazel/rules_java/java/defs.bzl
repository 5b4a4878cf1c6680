"""Offline stand-in for @rules_java//java:defs.bzl: Bazel 4's native Java rules, under rules_java's names.

@bazel_tools//tools/jdk loads these while Bazel registers its toolchains, even for a C++-only build;
the project builds no Java. See third_party/bazel/README.md.
"""

def java_binary(**kwargs):
    native.java_binary(**kwargs)

def java_import(**kwargs):
    native.java_import(**kwargs)

def java_library(**kwargs):
    native.java_library(**kwargs)

def java_proto_library(**kwargs):
    native.java_proto_library(**kwargs)

def java_runtime(**kwargs):
    native.java_runtime(**kwargs)

def java_toolchain(**kwargs):
    native.java_toolchain(**kwargs)
