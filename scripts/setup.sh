#!/usr/bin/env bash
# Installs what mha needs on Debian 12 (as root) and configures + builds one build tree.
# usage: scripts/setup.sh BUILD_DIR [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: compilers and build tools, the libraries mha links (cairo for the pictures, with
# the DejaVu fonts it draws text in, found through fontconfig), GoogleTest and Google Benchmark, and
# python3 for the conformance checker, and what the Python package builds and tests with
# (python3-dev, pybind11-dev, python3-numpy, python3-pytest). PyTorch is not needed to build or test
# (the golden data is committed; the mha.torch tests skip without it); regenerating goldens,
# bench/compare.py and the mha.torch tests need Debian's python3-torch, which MHA_REQUIRE_TORCH=1
# installs here (scripts/test.sh sets it), with the OpenMP build of OpenBLAS (libopenblas0-openmp:
# the pthread build starts a second thread pool inside torch's OpenMP regions). clang-14 with its
# sanitizer/libFuzzer runtime (libclang-rt-14-dev) and OpenMP (libomp-14-dev) builds the fuzzer of
# scripts/fuzz.sh. OpenMPI (libopenmpi-dev, openmpi-bin: mpirun) builds and tests mha::dist, the
# distributed attention of include/mha/dist.h.
packages=(g++ cmake ninja-build pkg-config git libdnnl-dev libhwy-dev libcairo2-dev fonts-dejavu-core
          fontconfig libcli11-dev nlohmann-json3-dev libgtest-dev libgmock-dev libbenchmark-dev python3
          python3-dev pybind11-dev python3-numpy python3-pytest clang-14 libclang-rt-14-dev libomp-14-dev
          libopenmpi-dev openmpi-bin)
if [[ ${MHA_REQUIRE_TORCH:-0} == 1 ]]; then packages+=(python3-torch libopenblas0-openmp); fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

build_dir=${1:?usage: scripts/setup.sh BUILD_DIR [cmake args]}
shift
cmake -S . -B "$build_dir" -G Ninja "$@" >/dev/null
cmake --build "$build_dir" -j "$(nproc)"
