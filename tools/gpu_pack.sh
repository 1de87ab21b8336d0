#!/usr/bin/env bash
# tools/gpu_pack.sh: packs a bundle build tree's commands, GPU tests and the shared libraries
# they need into one folder that can travel to a GPU host (for tools/gpu_check.sh there).
#
#   tools/gpu_pack.sh BUILD PACK
#
# BUILD is a tree configured as tools/bundle.sh does (-DDC_STATIC_DEPS=ON, with
# -DDC_BUILD_TESTS=ON) and built with the targets below, e.g.
#   cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DDC_STATIC_DEPS=ON \
#     -DCMAKE_PROJECT_INCLUDE=$PWD/cmake/bundle.cmake -DDC_CUDA_ARCHITECTURES=90
#   cmake --build build-gpu --target dc-run dc-collect dc-plan dc-trace dc_inject \
#     cuda_kernels_test cuda_executor_test cupti_collector_test dc_cupti_test_program PACK mirrors BUILD's layout for what
# it copies (tools/, lib/, the tests' folders), because the tests name dc-run, the injection
# library and the CUPTI test program by their paths in BUILD: on the GPU host, a link from
# BUILD's path to PACK makes those paths hold. Shared libraries beyond the system and CUDA go
# to PACK/lib, where the binaries' rpath ($ORIGIN/../lib) and gpu_check.sh look. PACK.tar.xz
# beside it holds the same (about 30 MB against PACK's 125 MB), for hosts that take files in a
# size limit; unpack it with `tar -xJf` or Python's tarfile.
set -euo pipefail
build=$(cd "${1:?usage: gpu_pack.sh BUILD PACK}" && pwd)
pack=${2:?usage: gpu_pack.sh BUILD PACK}
files=(tools/dc-run tools/dc-collect tools/dc-plan tools/dc-trace lib/libdc_inject.so
       executor/cuda/cuda_kernels_test executor/cuda/cuda_executor_test
       collector/cupti/cupti_collector_test collector/cupti/dc_cupti_test_program)
system_lib='^(linux-vdso|libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|libutil|ld-linux-x86-64|libz|libcrypto)\.so'
cuda_lib='^(libcuda|libcudart|libnccl|libcublas|libcublasLt|libcupti|libnvidia-ml|libnvrtc|libnvJitLink)\.so'
rm -rf "$pack"
mkdir -p "$pack/lib"
for f in "${files[@]}"; do
  [ -f "$build/$f" ] || { echo "gpu_pack: $build/$f is missing: build it first" >&2; exit 1; }
  mkdir -p "$pack/$(dirname "$f")"
  cp "$build/$f" "$pack/$f"
  strip --strip-unneeded "$pack/$f"
  ldd "$build/$f" | awk '$2 == "=>" { print $1, $3 }' | while read -r lib path; do
    [[ "$lib" =~ $system_lib || "$lib" =~ $cuda_lib ]] && continue
    [ -e "$pack/lib/$lib" ] || { cp -L "$path" "$pack/lib/$lib"; strip --strip-unneeded "$pack/lib/$lib"; }
  done
done
echo "$build" >"$pack/BUILD_PATH"
XZ_OPT="-6 -T0" tar -C "$pack" -cJf "$pack.tar.xz" .
du -sh "$pack" "$pack.tar.xz"
