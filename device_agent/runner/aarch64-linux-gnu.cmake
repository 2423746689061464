# CMake toolchain for cross-building mobizo_runner on an x86-64 Debian host for aarch64 Linux (a Jetson, or a
# phone's Linux userland under qemu-user in CI), with Debian's g++-aarch64-linux-gnu and libc6-arm64-cross.
# build.sh --aarch64 uses it; ExecuTorch comes from its aarch64 wheel, unpacked by build.sh.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
