"""Builds kungfu/_kungfu.so and kungfu/ops/_eager.so and installs the kungfu package:
pip install --no-build-isolation .

The library holds the engine (cc/, cc/transport/, cc/collective/, cc/p2p/) and the TensorFlow kernels
(kf_ops/). Its flags come from tools/tf_config.py (tf.sysconfig), as Bazel's do. kungfu/ops/_eager.so is a
small Python extension (python/kungfu/ops/_eager.cc: the eager collectives' C way to the library's C API),
built with the same flags plus Python's headers, and linked to TF's C API library (libtensorflow_cc).
Objects are kept under build/ and recompiled only when their source, a header they include (from the
compiler's .d files) or the flags change, up to one compiler per core at a time. Python sources come from
python/kungfu, and policies/ is installed as kungfu.policies.
"""

import concurrent.futures
import glob
import os
import shlex
import subprocess
import sys
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import tf_config  # noqa: E402  (tools/ is not a package)

SOURCE_GLOBS = ["cc/*.cc", "cc/transport/*.cc", "cc/collective/*.cc", "cc/p2p/*.cc", "kf_ops/*.cc"]
OPT_FLAGS = ["-O3", "-DNDEBUG", "-fPIC", "-pthread"]  # Bazel: -c opt --copt=-O3 (.bazelrc)


EAGER_SOURCE = "python/kungfu/ops/_eager.cc"


def library_sources():
    return sorted(path for pattern in SOURCE_GLOBS for path in glob.glob(pattern, root_dir=ROOT))


def python_include():
    """Python's include directory, checked: the eager extension needs Python.h."""
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise RuntimeError(f"kungfu: Python's headers are missing ({include}/Python.h): install them (Debian: "
                           "apt-get install python3-dev; `make deps` does) and build again")
    return include


def _read(path):
    with open(path) as f:
        return f.read()


def _needs_compile(obj, dep_file):
    """True unless obj is newer than every file its .d file lists (source and headers)."""
    if not (os.path.exists(obj) and os.path.exists(dep_file)):
        return True
    deps = _read(dep_file).replace("\\\n", " ").partition(":")[2].split()
    obj_time = os.path.getmtime(obj)
    return any(not os.path.exists(d) or os.path.getmtime(d) > obj_time for d in deps)


class BuildKungfu(build_ext):
    """Compiles and links each shared object with the flags from tools/tf_config.py (the eager extension
    also with Python's headers and TF's C API library), each into its own folder of objects."""

    def get_ext_filename(self, ext_name):
        return os.path.join(*ext_name.split(".")) + ".so"  # kungfu/_kungfu.so, no ABI tag

    def build_extension(self, ext):
        flags = tf_config.tf_flags()
        cxx = shlex.split(os.environ.get("CXX", "c++"))
        cflags = OPT_FLAGS + ["-I" + ROOT] + flags["cflags"]
        ldflags = flags["ldflags"]
        obj_name = "kungfu_obj"
        if ext.name == "kungfu.ops._eager":
            cflags = cflags + ["-I" + python_include()]
            ldflags = ldflags + ["-L" + flags["lib_dir"], "-l:libtensorflow_cc.so.2"]
            obj_name = "eager_obj"
        obj_dir = os.path.join(os.path.abspath(self.build_temp), obj_name)
        os.makedirs(obj_dir, exist_ok=True)
        # Objects built with other flags are removed, so a failed build leaves none behind.
        flags_file, flags_text = os.path.join(obj_dir, "cflags.txt"), shlex.join(cxx + cflags)
        same_flags = os.path.exists(flags_file) and _read(flags_file) == flags_text

        jobs, objects = [], []
        for src in ext.sources:
            obj = os.path.join(obj_dir, src[: -len(".cc")] + ".o")
            objects.append(obj)
            if self.force or not same_flags or _needs_compile(obj, obj[:-2] + ".d"):
                if os.path.exists(obj):
                    os.remove(obj)
                os.makedirs(os.path.dirname(obj), exist_ok=True)
                jobs.append(cxx + cflags + ["-MMD", "-MF", obj[:-2] + ".d", "-c", src, "-o", obj])
        with open(flags_file, "w") as f:
            f.write(flags_text)
        print(f"kungfu: compiling {len(jobs)} of {len(objects)} sources", flush=True)
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            results = list(pool.map(lambda cmd: subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True), jobs))
        failed = [r for r in results if r.returncode != 0]
        for r in results:
            sys.stderr.write(r.stdout + r.stderr)
        if failed:
            raise RuntimeError("kungfu: failed to compile " + ", ".join(r.args[-3] for r in failed))

        output = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(output), exist_ok=True)
        link = cxx + ["-shared", "-o", output] + objects + ldflags + ["-pthread"]
        subprocess.run(link, cwd=ROOT, check=True)


def packages():
    policies = ["kungfu.policies"] + ["kungfu.policies." + p for p in find_packages(os.path.join(ROOT, "policies"))]
    return find_packages(os.path.join(ROOT, "python")) + policies


setup(
    name="kungfu",
    version="0.1.0",
    description="Adaptive distributed training for TensorFlow 2 and Keras 3",
    python_requires=">=3.10",
    package_dir={"": "python", "kungfu.policies": "policies"},
    packages=packages(),
    ext_modules=[Extension("kungfu._kungfu", sources=library_sources()),
                 Extension("kungfu.ops._eager", sources=[EAGER_SOURCE])],
    cmdclass={"build_ext": BuildKungfu},
    entry_points={"console_scripts": ["kfrun=kungfu.launcher:main"]},
    install_requires=["tensorflow-cpu==2.21.0", "absl-py", "numpy"],
    zip_safe=False,
)
