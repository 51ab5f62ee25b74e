#!/usr/bin/env bash
# Build DeepGEMM (2.x, from a source checkout with its third-party/cutlass and
# third-party/fmt submodules present) in place against the installed torch, so that
# `gemmspec bench` can time it live beside gemmspec. Run on the GPU machine; prints the
# PYTHONPATH entry that makes `deep_gemm` importable.
#
#   bash scripts/build_deepgemm.sh SRC_DIR [BUILD_DIR]     (BUILD_DIR defaults to /tmp/deepgemm)
#
# It builds with the system's g++ where there is one: the compiler must match the C++
# library the process loads. A build by a newer GCC than the loaded libstdc++ crashed
# inside std::regex at DeepGEMM's first just-in-time compile, taking the bench with it.
# DeepGEMM's compiler needs CUDA_HOME at run time too; the printed line sets it.
set -euo pipefail
src=${1:?usage: scripts/build_deepgemm.sh SRC_DIR [BUILD_DIR]}
build=${2:-/tmp/deepgemm}
for need in setup.py deep_gemm/__init__.py third-party/cutlass/include/cute third-party/fmt/include; do
  if [ ! -e "$src/$need" ]; then
    echo "build_deepgemm: $src/$need is missing (a DeepGEMM 2.x checkout with its submodules is needed)" >&2
    exit 2
  fi
done
nvcc=$(command -v nvcc) || { echo "build_deepgemm: nvcc is not on the PATH" >&2; exit 2; }
cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")}
cxx=${CXX:-$(command -v /usr/bin/g++ || command -v g++)}
cc=${CC:-$(command -v /usr/bin/gcc || command -v gcc)}
rm -rf "$build"
cp -r "$src" "$build"
# DeepGEMM's just-in-time compiler finds CUTLASS under deep_gemm/include.
for lib in cute cutlass; do
  [ -e "$build/deep_gemm/include/$lib" ] || ln -s "../../third-party/cutlass/include/$lib" "$build/deep_gemm/include/$lib"
done
(cd "$build" && CUDA_HOME="$cuda_home" CXX="$cxx" CC="$cc" DG_USE_LOCAL_VERSION=0 \
  python3 setup.py build_ext --inplace > build.log 2>&1) || { tail -20 "$build/build.log" >&2; exit 1; }
(cd /tmp && PYTHONPATH="$build${PYTHONPATH:+:$PYTHONPATH}" CUDA_HOME="$cuda_home" \
  python3 -c "import deep_gemm; print('build_deepgemm: deep_gemm', deep_gemm.__version__, 'built with $cxx')" >&2)
echo "export PYTHONPATH=$build\${PYTHONPATH:+:\$PYTHONPATH} CUDA_HOME=$cuda_home"
