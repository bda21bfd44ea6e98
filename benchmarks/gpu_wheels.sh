#!/usr/bin/env bash
# The wheels benchmarks/gpu.py needs on the device machine, whose image (Python 3.12, torch, triton, numpy,
# networkx, safetensors, tokenizers, pytest) lacks these or holds another version: into .whl/ (ignored), which
# the device call carries. See benchmarks/gpu.py's docstring for the command there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    transformers==5.24.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
    sqlalchemy==2.1.9 greenlet faiss-cpu==1.15.1 gguf==0.19.0 hypothesis==6.170.27 sortedcontainers==2.4.0
du -sh .whl
