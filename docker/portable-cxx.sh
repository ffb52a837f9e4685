#!/usr/bin/env bash
# The C++ compiler for DeepSpeed's pre-built CPU ops (the builder stage of docker/Dockerfile).
# DeepSpeed compiles cpu_adam and async_io with -march=native and the SIMD width of the machine
# that builds them; an image built on an AVX-512 host would then die with "illegal instruction" on
# an AVX2 host. This wrapper targets CPU_BASELINE instead (default x86-64-v3: AVX2, every x86 GPU
# server of the last decade). CPU_BASELINE=native keeps DeepSpeed's flags as they are.
baseline="${CPU_BASELINE:-x86-64-v3}"
if [ "$baseline" = native ]; then
    exec g++ "$@"
fi
args=()
for arg in "$@"; do
    case "$arg" in
        -march=native) args+=("-march=$baseline") ;;
        -D__AVX512__) args+=("-D__AVX256__") ;;
        *) args+=("$arg") ;;
    esac
done
exec g++ "${args[@]}"
