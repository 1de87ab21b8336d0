#!/usr/bin/env bash
# tools/bundle.sh: builds dc for a GPU host that lacks Debian's dev packages and packs it as
#   dist/dc-<version>-linux-x86_64/{bin,lib}  and  dist/dc-<version>-linux-x86_64.tar.gz
#
# bin/ holds dc-collect, dc-plan, dc-run, dc-trace and dc-env; lib/ holds libdc_inject.so and
# every shared library the binaries need that is neither a base system library (libc, libm,
# libstdc++, libgcc_s, libpthread, libdl, librt, ld-linux, libz, libcrypto) nor the host's
# CUDA 13 (driver, cuBLAS, NCCL, CUPTI): libgloo, OpenBLAS and theirs. protobuf, SQLite,
# libcrypto and the CUDA runtime are linked in (cmake/bundle.cmake, -DDC_STATIC_DEPS=ON); the
# binaries find lib/ through their $ORIGIN/../lib rpath. On the GPU host, `bin/dc-env` says in
# one line per library what the host is missing.
#
# Usage: tools/bundle.sh            (env: JOBS=<n> parallel jobs, BUILD_DIR=<dir>)
# Needs: cmake, a C++20 compiler, the dev packages the normal build needs, ldd, strip, tar.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build-bundle}
jobs=${JOBS:-$(nproc)}
version=$(sed -n 's/^project(dc VERSION \([0-9][0-9.]*\).*/\1/p' "$root/CMakeLists.txt")
[ -n "$version" ] || { echo "bundle: no 'project(dc VERSION x.y.z' in CMakeLists.txt" >&2; exit 1; }
name=dc-$version-linux-x86_64
dist=$root/dist/$name
tools=(dc-collect dc-plan dc-run dc-trace)

# Libraries a GPU host is expected to have: the base system, and CUDA 13 (found through the
# usual library path at run time, never copied).
system_lib='^(linux-vdso|libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|libutil|ld-linux-x86-64|libz|libcrypto)\.so'
cuda_lib='^(libcuda|libnccl|libcublas|libcublasLt|libcupti|libnvidia-ml|libnvrtc|libnvJitLink)\.so'

say() { echo "bundle: $*"; }
is_elf() { [ "$(head -c 4 "$1" 2>/dev/null | tail -c 3)" = ELF ]; }

say "configuring $build (DC_STATIC_DEPS=ON)"
mkdir -p "$build"
log=$build/bundle-configure.log
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDC_BUILD_TESTS=OFF \
  -DDC_STATIC_DEPS=ON -DCMAKE_PROJECT_INCLUDE="$root/cmake/bundle.cmake" >"$log" 2>&1 ||
  { cat "$log" >&2; echo "bundle: cmake configure failed (log above)" >&2; exit 1; }
targets=("${tools[@]}")
if grep -q 'dc: CUDA toolkit ON' "$log"; then
  targets+=(dc_inject)
else
  say "no CUDA toolkit: the bundle has no libdc_inject.so and no GPU backend"
fi
say "building ${targets[*]} with $jobs job(s)"
cmake --build "$build" -j "$jobs" --target "${targets[@]}"

rm -rf "$dist" "$dist.tar.gz"
mkdir -p "$dist/bin" "$dist/lib"
for tool in "${tools[@]}"; do
  install -m 755 "$build/tools/$tool" "$dist/bin/$tool"
done
if [ -f "$build/lib/libdc_inject.so" ]; then
  install -m 755 "$build/lib/libdc_inject.so" "$dist/lib/libdc_inject.so"
fi

# Copy what the ELF files need beyond the system and CUDA, until nothing new comes in.
copy_dependencies() {
  local changed=1
  while [ "$changed" = 1 ]; do
    changed=0
    for elf in "$dist"/bin/dc-* "$dist"/lib/*.so*; do
      is_elf "$elf" || continue
      while read -r lib path; do
        [[ "$lib" =~ $system_lib || "$lib" =~ $cuda_lib ]] && continue
        [ -e "$dist/lib/$lib" ] && continue
        if [ ! -f "$path" ]; then
          echo "bundle: $(basename "$elf") needs $lib, which this machine does not have" >&2
          exit 1
        fi
        cp -L "$path" "$dist/lib/$lib"
        chmod 755 "$dist/lib/$lib"
        changed=1
      done < <(ldd "$elf" | awk '$2 == "=>" { print $1, $3 }')
    done
  done
}
copy_dependencies
strip --strip-unneeded "$dist"/bin/dc-* "$dist"/lib/*.so*

cat >"$dist/bin/dc-env" <<'EOF'
#!/bin/sh
# dc-env: checks that this host has the libraries dc takes from it (the NVIDIA driver and
# CUDA 13's cuBLAS, NCCL and CUPTI), one line per missing library, then runs a dc command.
#   dc-env                  check only (exit 1 if something is missing)
#   dc-env dc-run ARGS...   check, then run bin/dc-run ARGS...
here=$(cd "$(dirname "$0")" && pwd)
hint() {
  case "$1" in
    libcuda.so*) echo "install the NVIDIA driver (R580 or newer runs CUDA 13)" ;;
    libnccl.so*) echo "install NCCL for CUDA 13 (libnccl2)" ;;
    libcublas*) echo "install CUDA 13's cuBLAS (libcublas-13-0)" ;;
    libcupti*) echo "install CUDA 13's CUPTI (cuda-cupti-13-0)" ;;
    *) echo "install it" ;;
  esac
}
# True when the dynamic loader can find $1 (LD_LIBRARY_PATH, then the ld.so cache).
findlib() {
  old_ifs=$IFS; IFS=:
  for dir in $LD_LIBRARY_PATH; do
    if [ -n "$dir" ] && [ -e "$dir/$1" ]; then IFS=$old_ifs; return 0; fi
  done
  IFS=$old_ifs
  /sbin/ldconfig -p 2>/dev/null | grep -q "^[[:space:]]*$1 " && return 0
  for dir in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib /lib/x86_64-linux-gnu; do
    [ -e "$dir/$1" ] && return 0
  done
  return 1
}
missing=$( {
  # The CUDA runtime is linked in and loads the driver itself: not in ldd's list.
  findlib libcuda.so.1 || echo libcuda.so.1
  for f in "$here"/dc-collect "$here"/dc-plan "$here"/dc-run "$here"/dc-trace \
           "$here"/../lib/libdc_inject.so; do
    [ -e "$f" ] && ldd "$f" 2>/dev/null | awk '/not found/ { print $1 }'
  done
} | sort -u)
if [ -n "$missing" ]; then
  for lib in $missing; do
    echo "dc: $lib not found; $(hint "$lib") or add its directory to LD_LIBRARY_PATH" >&2
  done
  exit 1
fi
if [ $# -eq 0 ]; then
  echo "dc: this host has every library dc needs"
  exit 0
fi
tool=$1; shift
case "$tool" in */*) ;; *) [ -x "$here/$tool" ] && tool=$here/$tool ;; esac
exec "$tool" "$@"
EOF
chmod 755 "$dist/bin/dc-env"

# Every binary's dependencies: the system, CUDA 13, or lib/ beside it. The bundled libraries'
# own dependencies are resolved through the binaries' rpath, so ldd of the binaries covers them.
say "dependencies (ldd):"
status=0
for elf in "$dist"/bin/dc-* "$dist"/lib/libdc_inject.so; do
  [ -e "$elf" ] || continue
  is_elf "$elf" || continue
  echo "  ${elf#"$dist"/}:"
  while read -r lib arrow path _; do
    [ "$arrow" = "=>" ] || { path=$lib; lib=$(basename "$lib"); }
    where=system
    if [[ "$lib" =~ $cuda_lib ]]; then
      where="host CUDA"
    elif [[ "$path" == "$dist/lib/"* ]] || [[ "$path" == "$dist/bin/../lib/"* ]]; then
      where=bundled
    elif ! [[ "$lib" =~ $system_lib ]]; then
      where="NOT ALLOWED"
      status=1
    fi
    printf '    %-28s %-12s %s\n' "$lib" "$where" "$path"
  done < <(ldd "$elf" | awk 'NF >= 2 && $1 != "statically" { print $1, $2, $3 }')
done
[ "$status" = 0 ] || { echo "bundle: a binary depends on a library outside the allowed set" >&2; exit 1; }

# The newest glibc and libstdc++ symbol versions the bundle uses: the host needs at least these.
elves=()
for elf in "$dist"/bin/* "$dist"/lib/*; do is_elf "$elf" && elves+=("$elf"); done
versions=$(objdump -T "${elves[@]}" | grep -o 'GLIBC\(XX\)\?_[0-9][0-9.]*' | sort -u -V || true)
glibc=$(grep '^GLIBC_' <<<"$versions" | tail -1 || true)
glibcxx=$(grep '^GLIBCXX_' <<<"$versions" | tail -1 || true)

tar -C "$root/dist" -czf "$dist.tar.gz" "$name"
say "wrote $dist ($(du -sh "$dist" | cut -f1)) and $dist.tar.gz ($(du -h "$dist.tar.gz" | cut -f1))"
say "the host needs glibc >= ${glibc#GLIBC_} and libstdc++ with ${glibcxx:-no GLIBCXX symbols}"
