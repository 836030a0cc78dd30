"""Builds tarn_client with its gRPC stubs generated from the repository's proto/ by grpcio-tools.

The proto file is compiled as `tarn_client/_gen/tarn.proto` so that the generated modules import
each other inside this package (`from tarn_client._gen import tarn_pb2`) instead of claiming a
top-level `tarn` package.
"""

import os
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.join(HERE, "..", "..", "proto", "tarn", "v1", "tarn.proto")


def generate(out_dir):
    from grpc_tools import protoc  # a build requirement (pyproject.toml)

    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        staged = os.path.join(tmp, "tarn_client", "_gen")
        os.makedirs(staged)
        shutil.copy(PROTO, os.path.join(staged, "tarn.proto"))
        target = os.path.join(out_dir, "tarn_client", "_gen")
        os.makedirs(target, exist_ok=True)
        code = protoc.main([
            "grpc_tools.protoc",
            f"-I{tmp}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            os.path.join(staged, "tarn.proto"),
        ])
        if code != 0:
            raise RuntimeError(f"grpc_tools.protoc failed on {PROTO} (exit {code})")
        with open(os.path.join(target, "__init__.py"), "w") as f:
            f.write('"""Generated from proto/tarn/v1/tarn.proto at build time."""\n')


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        generate(self.build_lib)

    def get_outputs(self, include_bytecode=True):
        # Declared so that editable and wheel installs list the generated modules too.
        outputs = super().get_outputs(include_bytecode)
        gen = os.path.join(self.build_lib, "tarn_client", "_gen")
        return outputs + [os.path.join(gen, n) for n in ("__init__.py", "tarn_pb2.py", "tarn_pb2_grpc.py")]


setup(cmdclass={"build_py": BuildWithStubs})
