#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4 and its CuTe DSL) onto the device machine, whose transfers are 64 MiB a call: its
# CUDA 13 libraries are a 92 MB wheel (227 MB unpacked), so they travel as an xz archive in two parts, one per call,
# to one warm machine (it is given back 30 s after a call: send the second at once).
#   here:            bash benchmarks/fa4_carry.sh prepare   # ~10 min (xz); fills .fa4a/ and .fa4b/ (both ignored)
#   device, call 1:  carry [".fa4a"]:         bash benchmarks/fa4_carry.sh stash
#   device, call 2:  carry [".whl", ".fa4b"]: bash benchmarks/fa4_carry.sh install && STAGES=... bash \
#                    benchmarks/speed_session.sh   (speed_session.sh puts $FA4_SITE on the path where it exists)
# The versions are pyproject.toml's `fa4` extra (keep them equal): the ones the twenty-first session ran (flash-attn-4
# 4.0.0b40), whose private entry points moetune::fa4_varlen calls (model/flash_attention_4.py).
set -euo pipefail
FA4_SITE=${FA4_SITE:-/tmp/fa4_site}
PARTS=/tmp/fa4_parts
PY=${PY:-python3}
case ${1:-} in
  prepare)
    W=$(mktemp -d)
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$W" \
      flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
      nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 "apache-tvm-ffi>=0.1.11,<0.2" \
      torch-c-dlpack-ext quack-kernels
    rm -rf .fa4a .fa4b && mkdir -p .fa4a .fa4b "$W/libs"
    (cd "$W/libs" && unzip -q "$W"/nvidia_cutlass_dsl_libs_cu13-*.whl)
    tar -C "$W/libs" -cf - . | xz -9 -T0 > "$W/libs.tar.xz"
    split -b 45M -d "$W/libs.tar.xz" .fa4a/libs.tar.xz.part
    mv .fa4a/libs.tar.xz.part01 .fa4b/
    find "$W" -maxdepth 1 -name "*.whl" ! -name "nvidia_cutlass_dsl_libs_cu13-*" -exec mv {} .fa4b/ \;
    rm -rf "$W"
    du -sh .fa4a .fa4b ;;
  stash)
    mkdir -p $PARTS && cp .fa4a/libs.tar.xz.part* $PARTS/ && ls -la $PARTS ;;
  install)
    cp .fa4b/libs.tar.xz.part* $PARTS/
    # the wheels first: pip --target --upgrade replaces a top-level folder that exists (nvidia_cutlass_dsl/, which
    # the libraries' archive fills too), so the archive is unpacked into what the wheels left
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$FA4_SITE" .fa4b/*.whl
    # Python's lzma and tarfile: the device image need not have the xz tool
    cat $PARTS/libs.tar.xz.part* | $PY -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz')\
.extractall('$FA4_SITE')"
    # the DSL's own packages sit in a folder its .pth file puts on the path in a site-packages install
    PYTHONPATH=$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-} $PY -c \
      "import flash_attn.cute.interface, cutlass; print('FA4 ready:', flash_attn.cute.interface.__file__)" ;;
  *) echo "usage: $0 prepare|stash|install" >&2; exit 2 ;;
esac
