# The bundle build (tools/bundle.sh): binaries that run on a GPU host without Debian's dev
# packages. With -DDC_STATIC_DEPS=ON: protobuf, SQLite and OpenSSL's libcrypto linked
# statically (Debian ships their .a files), the CUDA runtime statically, and every binary
# looks for the rest (libgloo, OpenBLAS, ...) in $ORIGIN/../lib, where the script copies
# them. cuBLAS, NCCL, CUPTI and the driver come from the host's CUDA 13 at run time.
# Off (the default), this file changes nothing.
#
# Included right after project(): tools/bundle.sh passes it as CMAKE_PROJECT_INCLUDE, so the
# top-level CMakeLists.txt needs no change (an include(cmake/bundle.cmake) there works too).
include_guard(GLOBAL)

option(DC_STATIC_DEPS "Link protobuf, SQLite and libcrypto statically; rpath \$ORIGIN/../lib"
       OFF)

if(DC_STATIC_DEPS)
  # FindProtobuf and FindOpenSSL pick their .a files with these.
  set(Protobuf_USE_STATIC_LIBS ON)
  set(OPENSSL_USE_STATIC_LIBS ON)
  # FindSQLite3 takes SQLite3_LIBRARY as given.
  find_library(DC_SQLITE3_STATIC NAMES libsqlite3.a)
  if(NOT DC_SQLITE3_STATIC)
    message(FATAL_ERROR "dc: DC_STATIC_DEPS needs libsqlite3.a (apt install libsqlite3-dev)")
  endif()
  set(SQLite3_LIBRARY ${DC_SQLITE3_STATIC} CACHE FILEPATH "SQLite, static for the bundle" FORCE)
  # What the static archives need from the system, at the end of every link line.
  string(APPEND CMAKE_CXX_STANDARD_LIBRARIES " -lz -ldl -lpthread -lm")
  # The CUDA runtime is linked in; binaries need only the host's driver for it.
  set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
  # Bundled shared libraries sit in lib/ beside bin/; libdc_inject.so is in lib/ itself.
  # DT_RPATH rather than DT_RUNPATH: it also serves the bundled libraries' own dependencies
  # (libopenblas needs libgfortran), which carry no search path of their own.
  set(CMAKE_BUILD_WITH_INSTALL_RPATH ON)
  set(CMAKE_INSTALL_RPATH "\$ORIGIN/../lib")
  string(APPEND CMAKE_EXE_LINKER_FLAGS " -Wl,--disable-new-dtags")
  string(APPEND CMAKE_SHARED_LINKER_FLAGS " -Wl,--disable-new-dtags")
  message(STATUS "dc: bundle build: static protobuf, SQLite, libcrypto; rpath \$ORIGIN/../lib")
endif()
